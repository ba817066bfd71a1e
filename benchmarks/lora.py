"""Benchmark: LoRA against full fine-tuning on one actor rank, back to back, on a real model.

    DS_ACCELERATOR=cpu .venv/bin/python -m benchmarks.lora [--model-path DIR] [--rank 64] \\
        [--prompts 8] [--n 8] [--prompt-len 60] [--max-response 128] [--out bench_lora.json]

Each side runs in a fresh subprocess (one in-process DeepSpeed rank, ZeRO-2, fp32 on CPU), one
after the other, on the same GRPO-shaped batch (``--prompts`` prompts of ``--prompt-len`` random
tokens, each answered ``--n`` times with uniform random lengths up to ``--max-response``; one
optimizer step over all rows, micro-batches of ``--n`` rows, as the SmolLM2 recipe). Per side it
prints (and writes as JSON):

- ``update_s``: one update, timed after a warm-up update that creates the optimizer state;
- ``ref_logprobs_s``: the reference log-probs of the batch (full: the frozen copy loaded for the KL
  term; LoRA: the same model with its adapters off, no second copy);
- ``peak_rss_mib``: the process's peak resident memory (ru_maxrss: model load, reference model,
  optimizer state, activations);
- ``trainable_params``.

The default model is SmolLM2-135M-Instruct as ``model=smollm2-135m`` builds it (``scripts/train.sh
model=smollm2-135m`` once). The load average is printed before and after each side.
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

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path(os.environ.get("BANDPO_CACHE", Path.home() / ".cache" / "bandpo")) / (
    "smollm2-135m-instruct-q4_1"
)


def grpo_batch(prompts: int, n: int, prompt_len: int, max_response: int, vocab: int, seed: int = 0):
    """``prompts`` random prompts, each answered ``n`` times (lengths uniform in [max/4, max])."""
    import torch

    from bandpo.types import RolloutBatch, TrainBatch

    g = torch.Generator().manual_seed(seed)
    rows_p, rows_r = [], []
    for _ in range(prompts):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            length = int(torch.randint(max_response // 4, max_response + 1, (1,), generator=g))
            rows_p.append(prompt)
            rows_r.append(torch.randint(10, vocab, (length,), generator=g).tolist())
    rows = len(rows_p)
    rb = RolloutBatch.from_lists(
        rows_p, rows_r, [[0.0] * len(r) for r in rows_r], list(range(rows)), ["stop"] * rows, pad_id=0
    )
    return rb, TrainBatch.from_rollout(rb, advantages=torch.randn(rows, generator=g))


def side(args) -> dict:
    """One side, in this process: build the actor, warm up, time an update and the reference pass."""
    import torch

    from bandpo.actor import Actor
    from bandpo.algo.options import LossOptions

    lora = {"rank": args.rank} if args.rank else None
    rows = args.prompts * args.n
    actor = Actor(
        str(args.model_path),
        mini_batch_size=rows,
        micro_batch_size=args.n,
        lr=1e-5,
        ref_model=not lora,
        lora=lora,
    )
    vocab = actor.engine.module.config.vocab_size
    rb, batch = grpo_batch(args.prompts, args.n, args.prompt_len, args.max_response, vocab)
    batch.old_logprobs, _ = actor.compute_logprobs(rb)
    batch.ref_logprobs, _ = actor.compute_logprobs(rb, ref=True)
    options = LossOptions(algorithm="grpo", kl_coef=0.001)
    actor.update(batch, options)  # warm-up: the optimizer state is created here
    t0 = time.perf_counter()
    actor.update(batch, options)
    update_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    actor.compute_logprobs(rb, ref=True)
    ref_s = time.perf_counter() - t0
    trainable = sum(p.numel() for p in actor.engine.module.parameters() if p.requires_grad)
    return {
        "side": f"lora r{args.rank}" if lora else "full",
        "update_s": update_s,
        "ref_logprobs_s": ref_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "trainable_params": trainable,
        "response_tokens": int(rb.response_mask.sum()),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank of the LoRA side (all seven projections)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (and rows per micro-batch)")
    ap.add_argument("--prompt-len", type=int, default=60)
    ap.add_argument("--max-response", type=int, default=128)
    ap.add_argument("--out", default="bench_lora.json")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)  # one side, in this process
    args = ap.parse_args()
    if args.side:
        print("RESULT " + json.dumps(side(args)))
        return
    if not (args.model_path / "config.json").exists():
        sys.exit(
            f"bench_lora: no model at {args.model_path} (build it once: scripts/train.sh model=smollm2-135m)"
        )
    results = []
    for rank in (0, args.rank):  # full first, then LoRA, back to back
        print(f"load average before: {os.getloadavg()}", flush=True)
        cmd = [sys.executable, "-m", "benchmarks.lora", "--side", *sys.argv[1:], "--rank", str(rank)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"bench_lora: the rank={rank} side failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
        print(results[-1], f"\nload average after: {os.getloadavg()}", flush=True)
    full, lora = results
    ratios = {
        "update_full_over_lora": full["update_s"] / lora["update_s"],
        "peak_rss_full_over_lora": full["peak_rss_mib"] / lora["peak_rss_mib"],
    }
    print(json.dumps(ratios, indent=1))
    Path(args.out).write_text(json.dumps({"sides": results, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
