"""scripts/gpu_smoke.py --cpu: every code path of the GPU mode on a tiny model, in-process: DeepSpeed
ZeRO-2 and ZeRO-3 on one rank, shared-prompt groups, ActorOffload after a real optimizer step, the
plan's memory estimate beside the measured peak, the packed path against the padded reference, and
Actor.close between the stages."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_gpu_smoke_cpu_mode(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "gpu_smoke", Path(__file__).resolve().parents[2] / "scripts/gpu_smoke.py"
    )
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    spec = importlib.util.spec_from_file_location(
        "gpu_smoke_checks", Path(__file__).resolve().parents[2] / "scripts/gpu_smoke_checks.py"
    )
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    out = tmp_path / "smoke.json"
    result = smoke.main(["--cpu", "--rows", "8", "--workdir", str(tmp_path / "models"), "--out", str(out)])
    assert json.loads(out.read_text())["meta"]["device"] == "cpu"
    assert [r["zero_stage"] for r in result["stages"]] == [2, 3]
    prompt_tokens = result["stages"][0]["tokens"]
    for r in result["stages"]:
        assert r["packed_ok"], r  # within the fp32 bound of logprob_tolerance
        assert r["tokens_per_s"] > 0 and r["mfu"] is None  # no peak for a CPU
        # offload -> reload restores every weight, master weight and Adam moment bit for bit
        assert r["offload_max_diff"] == 0.0 and r["offload_states"] > 0, r
        assert r["estimate_gib"] > 0 and r["peak_gib"] > 0, r  # the memory comparison ran
        assert r["freed_after_close"], r  # Actor.close left nothing holding the model
        assert r["tokens"] == prompt_tokens  # same batch both stages
    # 8 rows in 2 groups: each group's prompt counted once, so fewer tokens than 8 prompts + responses
    rb = checks.random_batch(8, 16, 24, 512)
    assert (
        result["stages"][0]["tokens"]
        == checks.computed_tokens(rb)
        < int(rb.prompt_mask.sum() + rb.response_mask.sum())
    )
    assert result["ipc"] is None
