"""Benchmark: rollout throughput (vllm vs hf engine) and weight-sync cost, on random Qwen2 models.

For each model size (``tiny``: ~0.4M params; ``100m``: ~104M params, hidden 768 x 12 layers) and
each backend: generated tokens/s for ``--prompts`` x ``--n`` samples of up to ``--max-tokens``,
and the time to sync the full weights into the running engine, next to a plain in-memory copy
of the same bytes measured in the same run (medians of ``--reps`` interleaved repetitions):

    sync       = write_weights_shm (actor side) + update_weights_from_shm (engine side: "load"),
                 into the file (and the writer's mapping of it) kept from the last sync
    sync_new   = the same after deleting the file: fresh tmpfs pages to fault in every time
    write shm  = the actor side alone, copies on ``shm.COPY_THREADS`` threads; "1 thread": on one
    host MB    = bytes the writer copies into host memory per sync (``HostCopyCounter``, one thread)
    copy_fresh = one copy of every tensor into a newly allocated flat buffer
    copy_warm  = one copy of every tensor into an already touched flat buffer (memcpy speed)

    .venv/bin/python -m benchmarks.rollout [--models tiny,100m --backends vllm,hf --out bench_rollout.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

# build_tiny_model sizes; the tokenizer (and so the vocabulary) is the tiny one's, ~500 tokens.
MODELS = {
    "tiny": {},
    "100m": {
        "hidden_size": 768,
        "num_layers": 12,
        "num_heads": 12,
        "num_kv_heads": 4,
        "intermediate_size": 3072,
    },
}


def perturbed_weights(model_dir: str, scale: float = 0.01):
    """The model's HF-named parameters plus small noise (what an actor would hold after a step)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return [(n, p.detach()) for n, p in model.named_parameters()]


def interleaved_medians(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds per function; the functions take turns each repetition, so load from other
    processes on a shared machine hits all of them alike."""
    for fn in fns.values():
        fn()  # warm-up: first touch of shm pages, first RPC, allocator
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_sync(engine, weights, reps: int) -> dict:
    import torch

    from bandpo.flat_buffer import HostCopyCounter, copy_bytes_baseline, layout
    from bandpo.shm.weight_files import remove_shm, write_weights_shm

    path = f"/dev/shm/bandpo-bench-{os.getpid()}.bin"
    metas, tensors, total = layout(weights)
    warm = torch.empty(total, dtype=torch.uint8)
    views = [warm[m.offset : m.offset + m.nbytes].view(t.dtype).view(t.shape) for m, t in zip(metas, tensors)]

    def copy_warm():
        for v, t in zip(views, tensors):
            v.copy_(t)

    fns = {
        "copy_fresh_s": lambda: copy_bytes_baseline(weights),
        "copy_warm_s": copy_warm,
        "write_shm_s": lambda: write_weights_shm(weights, path),
        "write_shm_1t_s": lambda: write_weights_shm(weights, path, threads=1),
        "sync_new_1t_s": lambda: (
            remove_shm(path),
            engine.update_weights_from_shm(path, write_weights_shm(weights, path, threads=1)),
        ),
        "load_s": lambda: engine.update_weights_from_shm(path, metas),
        "sync_s": lambda: engine.update_weights_from_shm(path, write_weights_shm(weights, path)),
        "sync_new_s": lambda: (
            remove_shm(path),
            engine.update_weights_from_shm(path, write_weights_shm(weights, path)),
        ),
    }
    try:
        out = {"params": sum(t.numel() for t in tensors), "bytes": total, **interleaved_medians(fns, reps)}
        with HostCopyCounter() as counted:
            write_weights_shm(weights, path, threads=1)
        out["host_bytes_write"] = counted.bytes
    finally:
        remove_shm(path)
    out["sync_over_copy_fresh"] = out["sync_s"] / out["copy_fresh_s"]
    out["sync_over_copy_warm"] = out["sync_s"] / out["copy_warm_s"]
    out["sync_new_over_sync"] = out["sync_new_s"] / out["sync_s"]
    return out


def bench_one(backend: str, model_dir: str, prompts, args) -> dict:
    from bandpo.rollout import make_engine
    from bandpo.types import SamplingParams

    t0 = time.perf_counter()
    engine = make_engine(
        backend, model_dir, dtype="float32", enforce_eager=args.enforce_eager, kv_cache_gib=2
    )
    init_s = time.perf_counter() - t0
    try:
        engine.generate(prompts[:1], SamplingParams(n=2, max_tokens=8, seed=0))  # warm-up
        sp = SamplingParams(n=args.n, max_tokens=args.max_tokens, seed=0)
        t0 = time.perf_counter()
        batch = engine.generate(prompts, sp)
        gen_s = time.perf_counter() - t0
        tokens = int(batch.response_mask.sum())
        sync = bench_sync(engine, perturbed_weights(model_dir), args.reps)
    finally:
        engine.shutdown()
    return {"init_s": init_s, "gen_s": gen_s, "tokens": tokens, "tokens_per_s": tokens / gen_s, **sync}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--backends", default="vllm,hf")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bandpo-bench-models"))
    ap.add_argument("--out", default="bench_rollout.json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from transformers import AutoTokenizer

    from bandpo.models.tiny import build_tiny_model

    rows = []
    for name in args.models.split(","):
        model_dir = str(build_tiny_model(os.path.join(args.workdir, name), **MODELS[name]))
        tok = AutoTokenizer.from_pretrained(model_dir)
        msgs = [
            [{"role": "user", "content": f"What is {i} + {3 * i}? Answer: "}] for i in range(args.prompts)
        ]
        prompts = [
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"] for m in msgs
        ]
        for backend in args.backends.split(","):
            res = bench_one(backend, model_dir, prompts, args)
            rows.append({"model": name, "backend": backend, **res})
            print(
                f"done {name}/{backend}: {res['tokens_per_s']:.0f} tok/s, sync {res['sync_s'] * 1e3:.1f} ms",
                flush=True,
            )

    head = (
        f"{'model':6} {'engine':6} {'init s':>7} {'tok/s':>8} {'MB':>7} {'copy fresh':>11} {'copy warm':>10} "
        f"{'write shm':>10} {'1 thread':>9} {'load':>8} {'sync':>8} {'sync new':>9} {'1 thread':>9} "
        f"{'sync/fresh':>11} {'sync/warm':>10} {'new/sync':>9} {'host MB':>8}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['model']:6} {r['backend']:6} {r['init_s']:7.1f} {r['tokens_per_s']:8.0f} {r['bytes'] / 1e6:7.1f} "
            f"{r['copy_fresh_s'] * 1e3:9.1f}ms {r['copy_warm_s'] * 1e3:8.1f}ms {r['write_shm_s'] * 1e3:8.1f}ms "
            f"{r['write_shm_1t_s'] * 1e3:7.1f}ms {r['load_s'] * 1e3:6.1f}ms {r['sync_s'] * 1e3:6.1f}ms "
            f"{r['sync_new_s'] * 1e3:7.1f}ms {r['sync_new_1t_s'] * 1e3:7.1f}ms "
            f"{r['sync_over_copy_fresh']:10.2f}x {r['sync_over_copy_warm']:9.2f}x {r['sync_new_over_sync']:8.2f}x "
            f"{r['host_bytes_write'] / 1e6:8.1f}"
        )
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "workload": vars(args),
    }
    print(f"load average {os.getloadavg()}")
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
