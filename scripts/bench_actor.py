"""Actor training throughput: a random ~100M-parameter Qwen2 at 1 and more data-parallel ranks.

Each configuration runs as Ray actors (like production), on CPU with DS_ACCELERATOR=cpu
and gloo unless a GPU is present. Reported per rank count: training tokens/s (response
tokens, i.e. tokens in the loss, and all processed tokens), no-grad log-prob tokens/s, and
peak resident memory per rank (ru_maxrss, includes loading the model).

    DS_ACCELERATOR=cpu python scripts/bench_actor.py --ranks 1,2 --out bench_actor.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def build_model(path: str, hidden: int, layers: int, intermediate: int, vocab: int, kv_heads: int) -> int:
    """Write a random Qwen2 (no tokenizer: the actor does not need one) and return its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


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


def bench(model_dir: str, world: int, args, cpus_per_rank: int) -> dict:
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
        bf16=gpu,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    try:
        batch = make_batch(args.rows, args.prompt_len, args.response_len, args.vocab, seed=0)
        t0 = time.perf_counter()
        batch.old_logprobs, _ = group.compute_logprobs(batch)
        logprob_s = time.perf_counter() - t0
        loss_kwargs = {"algorithm": "bandpo", "agg": "seq-mean-token-mean"}
        group.update(batch, loss_kwargs)  # warm-up: allocator, first-step optimizer state
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            group.update(batch, loss_kwargs)
            times.append(time.perf_counter() - t0)
        import ray

        rss = ray.get([w.__ray_call__.remote(_peak_rss_mib) for w in group.workers])
    finally:
        group.shutdown()
    step_s = sum(times) / len(times)
    resp_tokens = args.rows * args.response_len
    all_tokens = args.rows * (args.prompt_len + args.response_len)
    return {
        "ranks": world,
        "update_s": step_s,
        "train_resp_tok_s": resp_tokens / step_s,
        "train_all_tok_s": all_tokens / step_s,
        "logprob_tok_s": all_tokens / logprob_s,
        "peak_rss_mib_per_rank": max(rss),
    }


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
        "--cpus-per-rank",
        type=int,
        default=None,
        help="CPU threads per rank (Ray sets OMP_NUM_THREADS from it); default: CPUs / most ranks, "
        "so every configuration gets the same threads per rank and scaling is visible",
    )
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import ray

    total_cpus = os.cpu_count() or 1
    ranks = [int(w) for w in args.ranks.split(",")]
    cpus_per_rank = args.cpus_per_rank or max(total_cpus // max(ranks), 1)
    ray.init(num_cpus=total_cpus, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(tmp, args.hidden, args.layers, args.intermediate, args.vocab, args.kv_heads)
        results = [bench(tmp, w, args, cpus_per_rank) for w in ranks]
    ray.shutdown()

    print(
        f"model: Qwen2 random, {n_params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}); batch {args.rows} rows x ({args.prompt_len} prompt + {args.response_len} "
        f"response) tokens, micro {args.micro}, ZeRO-{args.zero_stage}, "
        f"{cpus_per_rank} CPU/rank of {total_cpus}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'ranks':>5} {'update s':>9} {'train resp tok/s':>17} {'train all tok/s':>16} "
        f"{'logprob tok/s':>14} {'peak RSS/rank MiB':>18}"
    )
    for r in results:
        print(
            f"{r['ranks']:>5} {r['update_s']:>9.2f} {r['train_resp_tok_s']:>17.1f} "
            f"{r['train_all_tok_s']:>16.1f} {r['logprob_tok_s']:>14.1f} {r['peak_rss_mib_per_rank']:>18.0f}"
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
