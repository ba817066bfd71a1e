"""Benchmark: one actor update at DeepSpeed ZeRO stages 2, 1 and 0 on one rank, back to back, on a real model.

    DS_ACCELERATOR=cpu .venv/bin/python -m benchmarks.zero_stage [--model-path DIR] [--stages 2,1,0] \\
        [--repeats 2] [--out bench_zero_stage.json]

On one rank ZeRO partitions nothing, but stages 1-2 still copy every micro-batch's gradients into
their flat buffers; stage 0 leaves them in the parameters' .grad. This measures what that costs.
Each side runs in a fresh subprocess (one in-process DeepSpeed rank, fp32 on CPU, no reference
model), the stages alternating ``--repeats`` times, on ``benchmarks/lora.py``'s GRPO-shaped batch
(8 prompts x 8 samples, 60-token prompts, responses up to 128 tokens): 64 rows, two optimizer steps
of 32, micro-batches of 8. Per side it prints (and writes as JSON) one timed update after a warm-up
update that creates the optimizer state, the process's peak resident memory, the update's loss (equal
across stages up to float summation order) and the load average.

Stages 0 and 1 are not training options (``actor.zero_stage`` is 2 or 3): the actor is built here
directly. Stage 0 reports no gradient norm (DeepSpeed keeps none without ZeRO).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.lora import DEFAULT_MODEL, REPO, grpo_batch


def side(model_path: Path, stage: int) -> dict:
    """One stage, in this process: build the actor, warm up, time one update."""
    from bandpo.actor import Actor
    from bandpo.algo.options import LossOptions

    actor = Actor(
        str(model_path), mini_batch_size=32, micro_batch_size=8, lr=1e-5, ref_model=False, zero_stage=stage
    )
    rb, batch = grpo_batch(8, 8, 60, 128, actor.engine.module.config.vocab_size)
    batch.old_logprobs, _ = actor.compute_logprobs(rb)
    options = LossOptions(algorithm="grpo")
    actor.update(batch, options)  # warm-up: the optimizer state is created here
    t0 = time.perf_counter()
    metrics = actor.update(batch, options)
    return {
        "stage": stage,
        "update_s": time.perf_counter() - t0,
        "loss": metrics["loss"],
        "grad_norm": metrics.get("grad_norm"),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "response_tokens": int(rb.response_mask.sum()),
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--stages", default="2,1,0")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench_zero_stage.json")
    ap.add_argument("--side", type=int, help=argparse.SUPPRESS)  # one stage, in this process
    args = ap.parse_args()
    if args.side is not None:
        print("RESULT " + json.dumps(side(args.model_path, args.side)))
        return
    if not (args.model_path / "config.json").exists():
        sys.exit(
            f"bench_zero_stage: no model at {args.model_path} (build it once: scripts/train.sh model=smollm2-135m)"
        )
    stages = [int(s) for s in args.stages.split(",")]
    results = []
    for _ in range(args.repeats):
        for stage in stages:
            print(f"load average before: {os.getloadavg()}", flush=True)
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.zero_stage",
                "--model-path",
                str(args.model_path),
                "--side",
                str(stage),
            ]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"bench_zero_stage: the stage {stage} side failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
            print(results[-1], flush=True)
    best = {s: min(r["update_s"] for r in results if r["stage"] == s) for s in stages}
    summary = {f"update_s_stage{s}_best": t for s, t in best.items()}
    if 2 in best:
        summary |= {f"stage2_over_stage{s}": best[2] / t for s, t in best.items() if s != 2}
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({"sides": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
