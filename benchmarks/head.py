"""Benchmark: the actor's output head (per-token log-prob and entropy of the targets), chunked against online.

For each shape (SmolLM2's hidden 576 x vocabulary 49,152, and Qwen2.5's 151,936-entry vocabulary at
Qwen2.5-0.5B's hidden 896 by default) and dtype (fp32, bf16), both heads run back to back on the same
random inputs (``bandpo.actor.chunked.HEADS``: ``chunked`` projects chunks of tokens onto the whole
vocabulary, ``online`` walks vocabulary tiles once per block of tokens). Each case runs in a fresh
process, so its peak resident set is its own: one warm-up forward + backward (whose peak is reported,
above the resident set with the inputs in place), then ``--repeats`` timed ones (median reported). The
gradient flows to the hidden states and the weight, with upstream gradients on both the log-probs and
the entropy, as an update with an entropy term has them. A head named ``online:fp32`` (or
``chunked:fp32``) runs with ``model.fp32_head``'s float32 matmuls, to price that option in bf16.

Printed: the CPU (model, the flags that decide the matmul kernels, cores, torch threads), then per
case the forward and backward seconds, tokens/s over both, the process's CPU seconds for both (with
``--threads 1`` a measure of the work that other processes on a shared CPU do not inflate, unlike the
wall time), the peak above the inputs, the load average before and after the case, and the online
speed-up of each head over the first listed; the same as JSON in ``--out``. No timing is asserted: the CPU may be shared (the load
average says how busy it was).

    .venv/bin/python -m benchmarks.head [--tokens 2048 1024] [--dtypes fp32 bf16] [--repeats 3] \\
        [--out bench_head.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"smollm2": (576, 49_152), "qwen2.5": (896, 151_936)}  # (hidden, vocabulary)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")

REPO = Path(__file__).resolve().parents[1]  # the children run as `python -m benchmarks.head` from here


def cpu_info() -> dict:
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch

    return {
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(shape: str, dtype: str, head: str, tokens: int, repeats: int, chunk: int, threads: int) -> dict:
    """One head on one shape in this process: warm-up (peak memory), then ``repeats`` timed passes."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    from bandpo.actor.chunked import HEADS

    hidden_size, vocab = SHAPES[shape]
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(dt).requires_grad_()  # [T, H]
    weight = (0.05 * torch.randn(vocab, hidden_size, generator=g)).to(dt).requires_grad_()  # [V, H]
    targets = torch.randint(0, vocab, (tokens,), generator=g)  # [T]
    g_lp, g_ent = torch.randn(tokens, generator=g), 0.01 * torch.randn(tokens, generator=g)
    name, _, option = head.partition(":")
    if name not in HEADS or option not in ("", "fp32"):
        raise SystemExit(f"--heads: {head!r} is not one of {', '.join(HEADS)}, optionally with ':fp32'")
    fn = functools.partial(HEADS[name], fp32_head=option == "fp32")

    def once() -> tuple[float, float, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        lp, ent = fn(hidden, weight, targets, 1.0, chunk)
        t1, c1 = time.perf_counter(), time.process_time()
        torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
        return t1 - t0, time.perf_counter() - t1, c1 - c0, time.process_time() - c1

    base = _rss_bytes()
    once()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times = [once() for _ in range(repeats)]
    fwd, bwd, fwd_cpu, bwd_cpu = (statistics.median(t[i] for t in times) for i in range(4))
    return {
        "shape": shape,
        "hidden": hidden_size,
        "vocab": vocab,
        "dtype": dtype,
        "head": head,
        "tokens": tokens,
        "chunk": chunk,
        "forward_s": fwd,
        "backward_s": bwd,
        "total_s": fwd + bwd,
        "tokens_per_s": tokens / (fwd + bwd),
        "threads": torch.get_num_threads(),
        "cpu_s": fwd_cpu + bwd_cpu,
        "peak_extra_mib": peak / 2**20,
        "all_s": times,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument(
        "--tokens", nargs="+", type=int, default=[2048, 1024], help="tokens per shape, in --shapes' order"
    )
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument(
        "--heads",
        nargs="+",
        default=["chunked", "online"],
        help="chunked | online, each optionally with :fp32 (model.fp32_head: the matmuls in float32)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk", type=int, default=512, help="actor.logits_chunk_tokens (chunk or block)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads per case (0: torch's default, the cores)"
    )
    p.add_argument("--out", default="bench_head.json")
    p.add_argument("--single", nargs=3, metavar=("SHAPE", "DTYPE", "HEAD"), help=argparse.SUPPRESS)
    p.add_argument("--single-tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.single:
        print(json.dumps(run_case(*args.single, args.single_tokens, args.repeats, args.chunk, args.threads)))
        return
    if len(args.tokens) != len(args.shapes):
        p.error(f"--tokens needs one count per shape ({len(args.shapes)}), got {args.tokens}")
    info = cpu_info()
    print(
        f"cpu: {info['cpu']}  flags: {' '.join(info['flags']) or '-'}  cores: {info['cores']}  "
        f"torch {info['torch']} threads: {info['torch_threads']}"
    )
    cases = []
    for shape, tokens in zip(args.shapes, args.tokens):
        for dtype in args.dtypes:
            for head in args.heads:
                load_before = os.getloadavg()
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.head",
                    "--single",
                    shape,
                    dtype,
                    head,
                    "--single-tokens",
                    str(tokens),
                ]
                cmd += [
                    "--repeats",
                    str(args.repeats),
                    "--chunk",
                    str(args.chunk),
                    "--threads",
                    str(args.threads),
                ]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout
                case = json.loads(out.strip().splitlines()[-1])
                case["load_before"], case["load_after"] = load_before, os.getloadavg()
                cases.append(case)
                print(
                    f"{shape:8s} H={case['hidden']:<5d} V={case['vocab']:<6d} {dtype} {head:8s} "
                    f"T={tokens:<5d} fwd {case['forward_s']:.3f} s  bwd {case['backward_s']:.3f} s  "
                    f"{case['tokens_per_s']:7.0f} tok/s  cpu {case['cpu_s']:.3f} s ({case['threads']} thr)  peak +{case['peak_extra_mib']:.0f} MiB  "
                    f"load {load_before[0]:.2f} -> {case['load_after'][0]:.2f}",
                    flush=True,
                )
    speedups = {}  # each head against the first one listed (chunked by default), same shape and dtype
    for c in cases:
        ref = next(r for r in cases if r["shape"] == c["shape"] and r["dtype"] == c["dtype"])
        if ref is c:
            continue
        key = f"{c['shape']}/{c['dtype']}/{c['head']} vs {ref['head']}"
        s = speedups[key] = {
            "forward": ref["forward_s"] / c["forward_s"],
            "backward": ref["backward_s"] / c["backward_s"],
            "total": ref["total_s"] / c["total_s"],
            "cpu": ref["cpu_s"] / c["cpu_s"],
            "peak_extra_mib": [ref["peak_extra_mib"], c["peak_extra_mib"]],
        }
        print(
            f"{key}: forward {s['forward']:.2f}x  backward {s['backward']:.2f}x  total {s['total']:.2f}x  "
            f"cpu {s['cpu']:.2f}x  peak {s['peak_extra_mib'][0]:.0f} -> {s['peak_extra_mib'][1]:.0f} MiB"
        )
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"machine": info, "cases": cases, "speedup": speedups}, f, indent=2)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
