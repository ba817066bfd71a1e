"""Benchmark: Band bounds and every algorithm's policy loss on the paper's mini-batch (64 x 8192 tokens).

Prints a table and writes JSON. Timings are medians over interleaved repetitions (variants
take turns, so machine noise hits all of them alike); compare ratios within one run.

    .venv/bin/python -m benchmarks.band [--rows 64 --cols 8192 --reps 15 --device cpu --out bench_band.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bandpo.algo import (
    ALGORITHMS,
    MISMATCH_MODES,
    LossOptions,
    adaptive_delta,
    band_bounds,
    band_bounds_per_token,
    policy_loss,
)
from bandpo.algo.band import chi2_generator, kl_roots_logit, tv_generator


def realistic_old_logprobs(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """[rows, cols] float32: ~80% head tokens (p > 0.9), ~15% middle, ~5% tail down to p = 1e-8."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, cols, generator=gen)
    head = -torch.rand(rows, cols, generator=gen) * 0.1
    middle = torch.log(torch.rand(rows, cols, generator=gen) * 0.85 + 0.05)
    tail = -torch.rand(rows, cols, generator=gen) * 18.0 - 3.0
    return torch.where(u < 0.8, head, torch.where(u < 0.95, middle, tail)).float()


def median_ms(fns: dict, reps: int, device: str = "cpu") -> dict[str, float]:
    # CUDA kernels run asynchronously: synchronise around each call so the wall clock sees them.
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up (KL table build, allocator)
    for _ in range(reps):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def bounds_error(old: torch.Tensor, delta: float, sample: int = 65536) -> dict[str, dict[str, float]]:
    """Max abs / rel error of float32 bounds vs a float64 slow reference on a sample of tokens."""
    x32 = old.flatten()[:sample]
    x64 = x32.double()
    t = x64 - torch.log(-torch.expm1(x64))
    log_q_hi, log_q_lo = kl_roots_logit(t.clamp(-700, 700), delta)
    refs = {
        "kl": (torch.exp(log_q_lo - x64), torch.exp(log_q_hi - x64)),
        "tv": band_bounds(x64, tv_generator, delta),  # generic bisection, not the closed form
        "chi2": band_bounds(x64, chi2_generator, delta),
    }
    out = {}
    for div, (lo_ref, hi_ref) in refs.items():
        lo, hi = band_bounds(x32, div, delta)
        errs = {}
        for name, got, ref in (("lower", lo, lo_ref), ("upper", hi, hi_ref)):
            ok = ref > 1.2e-38  # float32-normal values
            diff = (got.double() - ref).abs()
            errs[f"{name}_max_abs"] = diff[ok].max().item()
            errs[f"{name}_max_rel"] = (diff / ref)[ok].max().item()
        out[div] = errs
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--delta", type=float, default=0.05)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (timings only; errors are checked on CPU)")
    ap.add_argument("--out", default="bench_band.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    old_cpu = realistic_old_logprobs(args.rows, args.cols)
    old = old_cpu.to(args.device)  # [rows, cols]
    logp0 = (old + 0.05 * torch.randn_like(old)).clamp(max=0.0)  # [rows, cols]
    adv = torch.randn(args.rows, device=args.device)  # [rows]
    mask = torch.ones(args.rows, args.cols, dtype=torch.long, device=args.device)  # [rows, cols]

    bound_fns = {div: (lambda d=div: band_bounds(old, d, args.delta)) for div in ("kl", "tv", "chi2")}
    # Entropy-adaptive band: per-token delta_t in [delta/4, 4 delta] from a synthetic old-policy
    # entropy (an exponential spread around 0.5 nat), "batch" normalisation.
    entropy = -torch.log(torch.rand(args.rows, args.cols, generator=torch.Generator().manual_seed(1))) * 0.5
    entropy = entropy.to(args.device)  # [rows, cols]
    d_range = (args.delta / 4, args.delta * 4)
    delta_t = adaptive_delta(entropy, delta_min=d_range[0], delta_max=d_range[1], scale=0.5).to(old.dtype)
    bound_fns.update(
        {
            f"{div}-adaptive": (lambda d=div: band_bounds_per_token(old, d, delta_t, d_range))
            for div in ("kl", "tv", "chi2")
        }
    )

    # The rollout engine's logprobs for the mismatch corrections: pi_old with bf16-sized noise.
    rollout = old + 0.01 * torch.randn_like(old)  # [rows, cols]

    def loss_fn(algorithm: str, divergence: str = "kl", old_entropy=None, **extra):
        opts = LossOptions(
            algorithm=algorithm, divergence=divergence, delta=args.delta, agg="seq-mean-token-mean", **extra
        )

        def run():
            logp = logp0.clone().requires_grad_()
            loss, metrics = policy_loss(
                logp, old, adv, mask, opts, old_entropy=old_entropy, rollout_logprobs=rollout
            )
            loss.backward()
            return loss

        return run

    loss_fns = {"grpo": loss_fn("grpo"), "clip_higher": loss_fn("clip_higher")}
    loss_fns.update({f"bandpo-{d}": loss_fn("bandpo", d) for d in ("kl", "tv", "chi2")})
    # Adaptive: the radius is computed inside the loss from the entropy (counted in its time).
    loss_fns["bandpo-kl-adaptive"] = loss_fn(
        "bandpo",
        "kl",
        band_adaptive="entropy",
        delta_min=d_range[0],
        delta_max=d_range[1],
        entropy_scale=0.5,
        old_entropy=entropy,
    )
    loss_fns["dcpo"] = loss_fn("dcpo", upper_cap=10.0)  # DAC's per-token bounds: a closed form, like tv
    # The rivals (a surrogate of their own: no ratio bounds, no dual clip) and the mismatch corrections on
    # top of grpo.
    loss_fns.update(
        {name: loss_fn(name, dual_clip=None) for name, algo in ALGORITHMS.items() if algo.bounds is None}
    )
    loss_fns.update({f"grpo+{mode}": loss_fn("grpo", mismatch=mode) for mode in MISMATCH_MODES[1:]})
    bounds_ms = median_ms(bound_fns, args.reps, args.device)
    loss_ms = median_ms(loss_fns, args.reps, args.device)
    errors = bounds_error(old_cpu, args.delta)

    tokens = args.rows * args.cols
    where = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"cpu, {torch.get_num_threads()} threads"
    )
    print(f"tokens per mini-batch: {tokens:,}  device: {where}  delta: {args.delta}")
    print("\n| bounds only | median ms | x fixed delta |\n|---|---|---|")
    for k, v in bounds_ms.items():
        print(f"| {k} | {v:.2f} | {v / bounds_ms[k.removesuffix('-adaptive')]:.2f} |")
    base, grpo = loss_ms["clip_higher"], loss_ms["grpo"]
    print("\n| policy loss fwd+bwd | median ms | x grpo | x clip_higher |\n|---|---|---|---|")
    for k, v in loss_ms.items():
        print(f"| {k} | {v:.2f} | {v / grpo:.2f} | {v / base:.2f} |")
    print("\n| bounds error vs float64 reference | lower max rel | upper max rel |\n|---|---|---|")
    for k, e in errors.items():
        print(f"| {k} | {e['lower_max_rel']:.2e} | {e['upper_max_rel']:.2e} |")
    print(f"load average: {os.getloadavg()}")
    result = {
        "tokens": tokens,
        "delta": args.delta,
        "device": where,
        "loadavg": os.getloadavg(),
        "bounds_ms": bounds_ms,
        "loss_fwd_bwd_ms": loss_ms,
        "ratio_vs_clip_higher": {k: v / base for k, v in loss_ms.items()},
        "ratio_vs_grpo": {k: v / grpo for k, v in loss_ms.items()},
        "bounds_error": errors,
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
