"""python -m bandpo.tools.gpu_smoke --cpu: every code path of the GPU mode on a tiny model, in-process: DeepSpeed
ZeRO-2 and ZeRO-3 on one rank with a reference model in the trainer's order (reference log-probs, an
update with the KL term, the reference offloaded and reloaded), shared-prompt groups, ActorOffload after a
real optimizer step, the
plan's memory estimate beside the measured peak, the packed path against the padded reference, and
Actor.close between the stages; then the LoRA check at both stages in bf16 (update, offload, save from
host memory, load into a new actor, exact compare). A stage that fails, or a plan that cannot be
computed (no Hydra), is recorded in its row and the run goes on."""

import argparse
import json

import pytest

from bandpo.tools.gpu_smoke import checks, lora
from bandpo.tools.gpu_smoke import cli as smoke

pytestmark = pytest.mark.integration


def test_gpu_smoke_cpu_mode(tmp_path, monkeypatch):
    plan_estimate = checks.plan_estimate

    def no_hydra_at_zero3(params, shape, stage, *a, **kw):  # as where Hydra is not installed
        if stage == 3:
            raise ModuleNotFoundError("No module named 'hydra'")
        return plan_estimate(params, shape, stage, *a, **kw)

    monkeypatch.setattr(checks, "plan_estimate", no_hydra_at_zero3)
    out = tmp_path / "smoke.json"
    result = smoke.main(["--cpu", "--rows", "8", "--workdir", str(tmp_path / "models"), "--out", str(out)])
    assert json.loads(out.read_text())["meta"]["device"] == "cpu"
    assert [r["zero_stage"] for r in result["stages"]] == [2, 3]
    prompt_tokens = result["stages"][0]["tokens"]
    for r in result["stages"]:
        assert "error" not in r and r["phase"] == "done", r
        assert r["packed_ok"], r  # within the fp32 bound of logprob_tolerance
        assert r["tokens_per_s"] > 0 and r["mfu"] is None  # no peak for a CPU
        # offload -> reload restores every weight, master weight and Adam moment bit for bit
        assert r["offload_max_diff"] == 0.0 and r["offload_states"] > 0, r
        assert r["peak_gib"] > 0, r  # the memory was measured, with or without a plan beside it
        assert r["freed_after_close"], r  # Actor.close left nothing holding the model
        assert r["tokens"] == prompt_tokens  # same batch both stages
        # the reference: one model's second copy before any update, bit for bit the same after its offload
        assert r["ref_ok"] and r["ref_reload_diff"] == 0.0 and r["ref_first_diff"] <= r["packed_tol"], r
        # no pinned memory on a CPU; the plan's figure for the tiny model is there all the same
        assert r["pinned_gib"] is None and r["pinned_plan_gib"] > 0, r
    # the plan's estimate where it could be computed; at ZeRO-3 the row keeps its measurements
    assert result["stages"][0]["estimate_gib"] > 0 and result["stages"][0]["estimate_error"] is None
    assert result["stages"][1]["estimate_gib"] is None
    assert "hydra" in result["stages"][1]["estimate_error"]
    # 8 rows in 2 groups: each group's prompt counted once, so fewer tokens than 8 prompts + responses
    rb = checks.random_batch(8, 16, 24, 512)
    assert (
        result["stages"][0]["tokens"]
        == checks.computed_tokens(rb)
        < int(rb.prompt_mask.sum() + rb.response_mask.sum())
    )
    assert result["ipc"] is None

    assert [r["zero_stage"] for r in result["lora"]] == [2, 3]
    for r in result["lora"]:
        assert "error" not in r and r["phase"] == "done" and r["ok"], r
        # the factors in the base's bf16 at both stages, DeepSpeed's master copy fp32, the file bf16
        assert (r["adapter_dtype"], r["base_dtype"], r["master_dtype"], r["file_dtype"]) == (
            "bf16",
            "bf16",
            "fp32",
            "bf16",
        ), r
        # saved while the weights were in host memory, loaded by a new actor: every state bit for bit
        assert r["weights_offloaded"] and r["load_states"] > 0, r
        assert r["file_max_diff"] == r["load_max_diff"] == r["offload_max_diff"] == 0.0, r
        assert r["load_logprob_diff"] == 0.0 and r["peak_gib"] > 0 and r["freed_after_close"], r
    assert result["lora"][0]["estimate_gib"] > 0 and result["lora"][1]["estimate_gib"] is None
    table = smoke.table(result["stages"], None) + "\n" + lora.lora_table(result["lora"])
    assert "ZeRO-3: no estimate (ModuleNotFoundError" in table and "LoRA ZeRO-3: no estimate" in table


def test_a_failing_stage_is_recorded_and_returns(tmp_path):
    args = argparse.Namespace(
        cpu=True, rows=4, prompt=8, response=8, token_budget=256, grad_ckpt=False, peak=None, lora_rank=4
    )
    missing = str(tmp_path / "no-model")
    row = checks.check_stage(missing, 2, args, smoke.TINY, 0, "float32")
    assert row["phase"] == "build" and "error" in row and row["freed_after_close"] is None, row
    row = lora.check_lora(missing, 3, args, smoke.TINY, 0, tmp_path)
    assert row["error"].startswith("build: ") and row["zero_stage"] == 3, row
    assert "failed at build: " in lora.lora_table([row])
