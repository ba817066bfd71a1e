"""Actor throughput and memory with a random Qwen2.

Two modes:

* data-parallel scaling (default): a ~100M-parameter model at 1 and more ranks as Ray
  actors (like production), fixed-length rows. Reported per rank count: training tokens/s
  (response tokens, i.e. tokens in the loss, and all processed tokens), no-grad log-prob
  tokens/s, and peak resident memory per rank (ru_maxrss, includes loading the model).

      DS_ACCELERATOR=cpu python -m benchmarks.actor --ranks 1,2 --out bench_actor.json

* ``--compare``: the padding-free path vs the padded one (``--old-path``) at the real
  vocabulary on one in-process rank, each measurement in a fresh subprocess, back to back:
  long-tailed response lengths (lognormal, median max/8, the first row at the cap), peak
  memory above the loaded model + optimizer (RSS sampled every 5 ms from /proc; the
  optimizer state is created by a warm-up step on a tiny batch first), tokens/s of the
  log-prob pass and of one update, and the fraction of processed tokens that are padding.
  The old path runs only at the smaller R (at R = 2,048 it needs more than 24 GB).
  ``--group-size G`` makes the rows GRPO groups (rows/G prompts, each answered G times); the
  new path then packs each prompt once per pass (``actor.share_prompts``), and one more
  measurement at the largest R runs it with sharing off. One measurement (``--single``) is
  ``benchmarks/actor_compare.py``'s.

      DS_ACCELERATOR=cpu python -m benchmarks.actor --compare --vocab 151936 --hidden 64 \
          --layers 2 --intermediate 256 --max-response 4096 --compare-r 1024,4096 [--group-size 8]

Both modes also measure the machine's matmul peak in the same run, in the dtype the actor computes in
(``--bf16 auto``: ``actor.bf16``'s rule, ``bandpo.distributed.precision``) and on each rank's threads
(all ranks at once): the best torch.mm FLOP/s over the model's projection shapes ([T, H] x [H, H],
[H, I], [I, H]). Each pass is then reported as a fraction of that peak, counting model FLOPs:
6 x params x tokens for an update (forward 2, backward 4), 2 x params x tokens for a log-prob pass,
tokens being those the passes process (shared prompts once, padding included). Attention's score
products are not counted, nor is the lm_head's cost being paid only at the response tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks.actor_compare import single
from benchmarks.common import build_model, matmul_peak, peak_fractions, resolved_bf16


def make_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """Prompts and responses of fixed lengths (the worst case for padding-free tricks: none)."""
    import torch

    from bandpo.types import RolloutBatch, TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, prompt_len), generator=g).tolist()
    responses = torch.randint(3, vocab, (rows, response_len), generator=g).tolist()
    rb = RolloutBatch.from_lists(
        prompts, responses, [[0.0] * response_len] * rows, list(range(rows)), ["length"] * rows, pad_id=0
    )
    return TrainBatch.from_rollout(rb, advantages=torch.randn(rows, generator=g))


def _peak_rss_mib(_actor) -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _rank_matmul_peak(actor, hidden: int, intermediate: int, bf16: bool) -> dict:
    import torch

    return matmul_peak(hidden, intermediate, torch.bfloat16 if bf16 else torch.float32, actor.device)


def bench(model_dir: str, world: int, args, cpus_per_rank: int, params: int) -> dict:
    import torch

    from bandpo.actor import ActorGroup

    gpu = torch.cuda.is_available()
    group = ActorGroup(
        model_dir,
        world,
        num_cpus_per_rank=cpus_per_rank,
        num_gpus_per_rank=int(gpu),
        zero_stage=args.zero_stage,
        mini_batch_size=args.rows,
        micro_batch_size=args.micro,
        lr=1e-6,
        bf16=resolved_bf16(args.bf16),
        gradient_checkpointing=args.gradient_checkpointing,
        padding_free=not args.old_path,
        max_tokens_per_micro_batch=0 if args.old_path else args.max_tokens,
    )
    try:
        batch = make_batch(args.rows, args.prompt_len, args.response_len, args.vocab, seed=0)
        t0 = time.perf_counter()
        batch.old_logprobs, _ = group.compute_logprobs(batch)
        logprob_s = time.perf_counter() - t0
        from bandpo.algo.options import LossOptions

        loss_options = LossOptions(algorithm="bandpo", agg="seq-mean-token-mean")
        group.update_epoch(batch, loss_options)  # warm-up: allocator, first-step optimizer state
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            group.update_epoch(batch, loss_options)
            times.append(time.perf_counter() - t0)
        import ray

        rss = ray.get([w.__ray_call__.remote(_peak_rss_mib) for w in group.workers])
        # every rank at once, on its own threads: the ranks share the machine as they did training
        peaks = ray.get(
            [
                w.__ray_call__.remote(
                    _rank_matmul_peak, args.hidden, args.intermediate, resolved_bf16(args.bf16)
                )
                for w in group.workers
            ]
        )
    finally:
        group.shutdown()
    step_s = sum(times) / len(times)
    resp_tokens = args.rows * args.response_len
    all_tokens = args.rows * (args.prompt_len + args.response_len)  # distinct fixed-length rows: no padding
    peak = sum(p["flops_per_s"] for p in peaks)
    return {
        **peak_fractions(params, all_tokens, step_s, all_tokens, logprob_s, peak),
        "matmul_peak_flops_per_s": peak,
        "matmul_peak_per_rank": peaks,
        "ranks": world,
        "update_s": step_s,
        "train_resp_tok_s": resp_tokens / step_s,
        "train_all_tok_s": all_tokens / step_s,
        "logprob_tok_s": all_tokens / logprob_s,
        "peak_rss_mib_per_rank": max(rss),
    }


def compare(args) -> None:
    """New path at every R of --compare-r, old path at the smallest, back to back in subprocesses."""
    import subprocess
    import sys

    rs = [int(r) for r in args.compare_r.split(",")]
    runs = [([], r) for r in rs] + [(["--old-path"], min(rs))]
    if args.group_size > 1:  # the same groups with every row's prompt packed
        runs.insert(len(rs), (["--no-share"], max(rs)))
    base = [a for a in sys.argv[1:] if a not in ("--compare",)]
    results = []
    for flags, r in runs:
        cmd = [sys.executable, "-m", "benchmarks.actor", *base, "--single", "--max-response", str(r), *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            raise SystemExit(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        results.append(json.loads(lines[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(
        f"{results[0]['matmul_peak']['dtype']}, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
        f"{args.rows} rows, prompts "
        f"{args.prompt_len // 2}-{args.prompt_len}, responses lognormal capped at R; new: max_tokens_per_micro_batch "
        f"{args.max_tokens}, chunk {args.chunk}; old: micro_batch_size {args.micro}; logprob_token_budget "
        f"{args.logprob_budget}; group size {args.group_size}; load average {os.getloadavg()}"
    )
    print(
        f"{'path':>4} {'R':>5} {'tokens':>6} {'lp extra GB':>11} {'upd extra GB':>12} {'lp tok/s':>9} "
        f"{'upd tok/s':>9} {'lp pad':>6} {'upd pad':>7} {'run/rows':>8} {'peak GFLOP/s':>12} {'lp/peak':>7} "
        f"{'upd/peak':>8}"
    )
    for x in results:
        print(
            f"{x['path']:>4} {x['max_response']:>5} {x['real_tokens']:>6} {x['logprob_extra_peak_gb']:>11.2f} "
            f"{x['update_extra_peak_gb']:>12.2f} {x['logprob_tok_s']:>9.0f} {x['update_tok_s']:>9.0f} "
            f"{x['logprob_padding_frac']:>6.1%} {x['update_padding_frac']:>7.1%} {x['update_run_over_rows']:>8.2f} "
            f"{x['matmul_peak']['flops_per_s'] / 1e9:>12.2f} {x['logprob_peak_frac']:>7.1%} "
            f"{x['update_peak_frac']:>8.1%}"
        )
    print(
        f"matmul peak in {results[0]['matmul_peak']['dtype']} on {results[0]['torch_threads']} threads (per run): "
        + ", ".join(f"{x['matmul_peak']['flops_per_s'] / 1e9:.2f}" for x in results)
        + " GFLOP/s"
    )
    new = {x["max_response"]: x for x in results if x["path"] == "new"}
    old = next(x for x in results if x["path"] == "old")
    same_r = new[old["max_response"]]
    peak = {r: max(x["logprob_extra_peak_gb"], x["update_extra_peak_gb"]) for r, x in new.items()}
    print(
        f"ratios at R={old['max_response']}: update tok/s new/old {same_r['update_tok_s'] / old['update_tok_s']:.2f}x, "
        f"log-prob tok/s new/old {same_r['logprob_tok_s'] / old['logprob_tok_s']:.2f}x; new extra peak "
        f"R={max(rs)} / R={min(rs)}: {peak[max(rs)] / peak[min(rs)]:.2f}"
    )
    unshared = next((x for x in results if x["path"] == "unsh"), None)
    if unshared is not None:
        shared = new[unshared["max_response"]]
        print(
            f"shared prompts at R={unshared['max_response']} (tokens/s of the rows' own tokens): update "
            f"{shared['update_tok_s'] / unshared['update_tok_s']:.2f}x, log-probs "
            f"{shared['logprob_tok_s'] / unshared['logprob_tok_s']:.2f}x the unshared packing"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="comma-separated data-parallel sizes")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="rows per update (= one optimizer mini-batch)")
    p.add_argument("--micro", type=int, default=2, help="rows per micro-batch per rank")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--steps", type=int, default=2, help="timed updates after one warm-up")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--bf16",
        choices=("auto", "true", "false"),
        default="auto",
        help="actor.bf16: auto = bf16 on GPU and on CPUs with AVX512-BF16 / AMX, fp32 elsewhere",
    )
    p.add_argument(
        "--cpus-per-rank",
        type=int,
        default=None,
        help="CPU threads per rank (Ray sets OMP_NUM_THREADS from it); default: CPUs / most ranks, "
        "so every configuration gets the same threads per rank and scaling is visible",
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--old-path", action="store_true", help="padded rows and full logits (the previous path)")
    p.add_argument(
        "--max-tokens", type=int, default=16384, help="actor.max_tokens_per_micro_batch (new path)"
    )
    p.add_argument("--chunk", type=int, default=512, help="actor.logits_chunk_tokens (new path)")
    p.add_argument("--logprob-budget", type=int, default=16384, help="actor.logprob_token_budget")
    p.add_argument("--compare", action="store_true", help="new vs old path, long-tailed lengths, one rank")
    p.add_argument(
        "--compare-r", default="1024,4096", help="--compare: the caps R of the new path (old: the smallest)"
    )
    p.add_argument("--max-response", type=int, default=4096, help="cap of the long-tailed response lengths")
    p.add_argument(
        "--group-size", type=int, default=1, help="--compare: rows per prompt (GRPO's n; 1 = distinct)"
    )
    p.add_argument("--no-share", action="store_true", help="actor.share_prompts=false (new path)")
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # one measurement of --compare
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.single:
        print(json.dumps(single(args)))
        return
    if args.compare:
        compare(args)
        return

    import ray

    total_cpus = os.cpu_count() or 1
    ranks = [int(w) for w in args.ranks.split(",")]
    cpus_per_rank = args.cpus_per_rank or max(total_cpus // max(ranks), 1)
    ray.init(address="local", num_cpus=total_cpus, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(tmp, args.hidden, args.layers, args.intermediate, args.vocab, args.kv_heads)
        results = [bench(tmp, w, args, cpus_per_rank, n_params) for w in ranks]
    ray.shutdown()

    print(
        f"model: Qwen2 random, {n_params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}); batch {args.rows} rows x ({args.prompt_len} prompt + {args.response_len} "
        f"response) tokens, micro {args.micro}, ZeRO-{args.zero_stage}, {'bf16' if resolved_bf16(args.bf16) else 'fp32'}, "
        f"{cpus_per_rank} CPU/rank of {total_cpus}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'ranks':>5} {'update s':>9} {'train resp tok/s':>17} {'train all tok/s':>16} "
        f"{'logprob tok/s':>14} {'peak RSS/rank MiB':>18} {'peak GFLOP/s':>12} {'upd GFLOP/s':>11} {'upd/peak':>8} "
        f"{'lp GFLOP/s':>10} {'lp/peak':>7}"
    )
    for r in results:
        print(
            f"{r['ranks']:>5} {r['update_s']:>9.2f} {r['train_resp_tok_s']:>17.1f} "
            f"{r['train_all_tok_s']:>16.1f} {r['logprob_tok_s']:>14.1f} {r['peak_rss_mib_per_rank']:>18.0f} "
            f"{r['matmul_peak_flops_per_s'] / 1e9:>12.2f} {r['update_flops_per_s'] / 1e9:>11.2f} "
            f"{r['update_peak_frac']:>8.1%} {r['logprob_flops_per_s'] / 1e9:>10.2f} {r['logprob_peak_frac']:>7.1%}"
        )
    first = results[0]["matmul_peak_per_rank"][0]
    print(
        f"matmul peak: torch.mm in {first['dtype']}, {first['threads']} threads per rank, all ranks at once, summed; "
        f"model FLOPs 6 x params x tokens (update), 2 x params x tokens (log-probs)"
    )
    report = {
        "params": n_params,
        "config": vars(args),
        "cpus": total_cpus,
        "cpus_per_rank": cpus_per_rank,
        "load_average_1m": os.getloadavg()[0],
        "results": results,
    }
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
