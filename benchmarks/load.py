"""Host memory of actor start-up: data-parallel ranks on one node building their models.

Starts ``--ranks`` actor ranks as separate processes (torch.distributed over gloo, like the
CPU layout; no Ray, so nothing else shares their memory), each building ``bandpo.actor.Actor``
(model, DeepSpeed engine and, with ``--ref``, the reference model) from a random Qwen2 of
about 100M parameters, then exiting. The parent samples every rank's memory every 10 ms from
/proc and reports the peak of the sum over ranks of

* RSS: resident pages, file-backed ones included (a memory-mapped checkpoint read by every
  rank counts once per rank here, although the page cache holds it once);
* anon: RSS minus file-backed and shared pages, i.e. the memory the ranks own: what N
  simultaneous full copies of a model cost.

Both for the whole start-up and for the loading of the model alone (each rank's peak while
its first ``load_model`` runs, summed): on CPU the whole start-up's peak is DeepSpeed
allocating the optimizer state in host memory, which on GPU goes to the GPU, leaving the
loading as the host's peak.

      DS_ACCELERATOR=cpu python -m benchmarks.load --zero-stage 3 --ref --out load.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _mib(pages: int) -> float:
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory(pid: int) -> tuple[float, float] | None:
    """(RSS MiB, anonymous MiB) of ``pid`` from /proc/<pid>/statm (resident, shared pages)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
    except OSError:
        return None
    rss, shared = int(fields[1]), int(fields[2])
    return _mib(rss), _mib(rss - shared)


def _watch_loading():
    """Per ``load_model`` call of the actor (the model, then the reference model): this process's
    peak (RSS, anonymous) MiB while it runs, sampled every 5 ms by a thread. The first call runs
    before DeepSpeed allocates anything: the loading alone, which is the host's peak on GPU, where
    the optimizer state goes to the GPU."""
    import threading

    import bandpo.actor.worker as worker

    peaks: list[list[float]] = []
    loading = threading.Event()

    def sample():
        while True:
            loading.wait()
            rss, anon = _memory(os.getpid())
            peaks[-1][0], peaks[-1][1] = max(peaks[-1][0], rss), max(peaks[-1][1], anon)
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    load = worker.load_model

    def watched(*a, **kw):
        peaks.append([0.0, 0.0])
        loading.set()
        try:
            return load(*a, **kw)
        finally:
            time.sleep(0.01)
            loading.clear()

    worker.load_model = watched
    return peaks


def rank_main(args) -> None:
    """One rank: build the actor, then exit (the parent measures)."""
    import torch

    from bandpo.actor import Actor

    load_peak = _watch_loading()
    t0 = time.perf_counter()
    actor = Actor(
        args.model,
        rank=args.rank,
        world_size=args.ranks,
        master_port=args.port,
        zero_stage=args.zero_stage,
        ref_model=args.ref,
        mini_batch_size=args.ranks,
        micro_batch_size=1,
        cpu_threads=1,
    )
    seconds = time.perf_counter() - t0
    if args.ranks > 1:
        torch.distributed.barrier()
    print(
        json.dumps(
            {
                "rank": args.rank,
                "build_s": seconds,
                "steps": actor.info()["global_steps"],
                "load_rss_mib": load_peak[0][0],
                "load_anon_mib": load_peak[0][1],
            }
        ),
        flush=True,
    )


def measure(model: str, args) -> dict:
    from bandpo.distributed.ports import free_port

    port = free_port()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.load",
                "--rank-worker",
                str(r),
                "--model",
                model,
                "--port",
                str(port),
                "--ranks",
                str(args.ranks),
                "--zero-stage",
                str(args.zero_stage),
                *(["--ref"] if args.ref else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(args.ranks)
    ]
    peak_rss = peak_anon = 0.0
    per_rank = [0.0] * args.ranks
    while any(p.poll() is None for p in procs):
        samples = [_memory(p.pid) for p in procs]
        live = [s for s in samples if s is not None]
        peak_rss = max(peak_rss, sum(s[0] for s in live))
        peak_anon = max(peak_anon, sum(s[1] for s in live))
        for r, s in enumerate(samples):
            if s is not None:
                per_rank[r] = max(per_rank[r], s[1])
        time.sleep(0.01)
    outs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"a rank failed (rc {p.returncode}):\n{err[-3000:]}")
    ranks = [json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) for out, _ in outs]
    return {
        "peak_rss_sum_mib": peak_rss,
        "peak_anon_sum_mib": peak_anon,
        "peak_anon_per_rank_mib": per_rank,
        "loading_rss_sum_mib": sum(r["load_rss_mib"] for r in ranks),
        "loading_anon_sum_mib": sum(r["load_anon_mib"] for r in ranks),
        "build_s": max(r["build_s"] for r in ranks),
    }


def _resave(path: str, dtype: str) -> None:
    """Store the model at ``path`` in ``dtype`` instead."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    model.save_pretrained(path, safe_serialization=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument(
        "--ref", action="store_true", help="also build the reference model (algorithm.kl_coef > 0)"
    )
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument(
        "--checkpoint-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype the random model is saved in (the shipped models are stored in bfloat16; the CPU "
        "actor trains in float32, so each rank casts)",
    )
    p.add_argument(
        "--model", help="an existing model folder (default: a random Qwen2 built in a temp folder)"
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--rank-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker is not None:
        args.rank = args.rank_worker
        rank_main(args)
        return

    from benchmarks.common import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tmp
        n_params = None
        if not args.model:
            n_params = build_model(tmp, args.hidden, args.layers, args.intermediate, args.vocab, kv_heads=2)
            if args.checkpoint_dtype != "float32":
                _resave(tmp, args.checkpoint_dtype)
        weights = sum(
            os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors")
        )
        result = measure(model, args)
    report = {
        "params": n_params,
        "ranks": args.ranks,
        "zero_stage": args.zero_stage,
        "ref": args.ref,
        "checkpoint_dtype": args.checkpoint_dtype,
        "checkpoint_mib": weights / 2**20,
        "load_average": os.getloadavg(),
        **result,
    }
    print(
        f"{args.ranks} ranks, ZeRO-{args.zero_stage}, reference model {'on' if args.ref else 'off'}, "
        f"{(n_params or 0) / 1e6:.0f}M params ({args.checkpoint_dtype} checkpoint {weights / 2**20:.0f} MiB, "
        "float32 training): "
        f"peak RSS summed over ranks {result['peak_rss_sum_mib']:.0f} MiB, anonymous {result['peak_anon_sum_mib']:.0f}"
        f" MiB (per rank {', '.join(f'{x:.0f}' for x in result['peak_anon_per_rank_mib'])}); while loading the "
        f"model (before DeepSpeed's state): RSS {result['loading_rss_sum_mib']:.0f} MiB, anonymous {result['loading_anon_sum_mib']:.0f} MiB "
        "(peaks per rank, summed); build "
        f"{result['build_s']:.1f} s; load average {report['load_average']}"
    )
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
