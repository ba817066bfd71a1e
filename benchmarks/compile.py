"""torch.compile (inductor) against eager on the actor's decoder layers: does fusing the elementwise
work (RMSNorm, SiLU x up, rotary, residual adds) speed up a training forward and backward on this CPU?

A stack of ``--layers`` transformers Llama decoder layers at a model's shape (default SmolLM2-135M:
hidden 576, MLP 1536, 9 query and 3 key/value heads), ``--rows`` x ~``--length`` tokens, forward and
backward of a scalar loss, in the dtype asked. Each layer is compiled on its own
(``torch.compile(layer, dynamic=True)``, as a per-layer compile of the actor would be); lengths vary
by 8 tokens between repetitions so that the compiled side runs with dynamic shapes, as packed
micro-batches do. The two sides alternate (eager, compiled, eager, compiled) and each reports its
first call (compilation included) and the best and median of the rest. Prints the machine (CPU,
flags, load) and one JSON line; no assertion.

    python -m benchmarks.compile [--bf16 true|false] [--layers 6] [--rows 12] [--length 192]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

from benchmarks.profile_actor_report import machine


def build(args, dtype):
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.kv_heads,
        num_hidden_layers=args.layers,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return [LlamaDecoderLayer(cfg, i).to(dtype) for i in range(args.layers)], LlamaRotaryEmbedding(cfg)


def step(layers, rope, rows: int, length: int, hidden: int, dtype) -> float:
    """Seconds of one forward and backward through ``layers`` at [rows, length] tokens."""
    import torch

    x = torch.randn(rows, length, hidden, dtype=dtype, requires_grad=True)  # [B, L, H]
    pos = torch.arange(length)[None].expand(rows, -1)  # [B, L]
    cos, sin = (t.to(dtype) for t in rope(x, pos))  # [B, L, head_dim] each
    t0 = time.perf_counter()
    y = x
    for layer in layers:
        out = layer(y, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
        y = out[0] if isinstance(out, tuple) else out
    y.float().square().mean().backward()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bf16", choices=("true", "false"), default="true")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--length", type=int, default=192)
    p.add_argument("--reps", type=int, default=6, help="calls per side and round (the first is the warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.bf16 == "true" else torch.float32
    print("machine:", machine(), "torch", torch.__version__, "threads", torch.get_num_threads(), flush=True)
    eager, rope = build(args, dtype)
    compiled = [torch.compile(copy.deepcopy(layer), dynamic=True) for layer in eager]
    result = {
        "dtype": str(dtype),
        "layers": args.layers,
        "rows": args.rows,
        "length": args.length,
        "rounds": [],
    }
    for r in range(args.rounds):
        row = {}
        for name, layers in (("eager", eager), ("compiled", compiled)):
            times = [
                step(layers, rope, args.rows, args.length + 8 * (i % 3), args.hidden, dtype)
                for i in range(args.reps)
            ]
            rest = times[1:]
            row[name] = {"first_s": times[0], "best_s": min(rest), "median_s": statistics.median(rest)}
            print(
                f"round {r} {name}: first {times[0]:.2f} s, best {min(rest):.3f} s, median "
                f"{statistics.median(rest):.3f} s",
                flush=True,
            )
        row["eager_over_compiled_median"] = row["eager"]["median_s"] / row["compiled"]["median_s"]
        result["rounds"].append(row)
    result["load_average_after"] = machine()["load_average"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
