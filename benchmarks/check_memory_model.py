"""The placement plan's memory model (``bandpo.distributed.footprint``) against a measured CPU peak.

One training step of a random ~135M-parameter Llama (SmolLM2-135M's shape: H 576, I 1536, 30
layers, 9 heads, 3 KV heads, vocabulary 49,152, tied embeddings) in fp32 on CPU, as the actor
runs it: rows packed without padding through the packed attention and the chunked lm_head
(``bandpo.actor.logprobs.packed_logprobs``), then torch's AdamW on its foreach path (the one
CUDA takes by default). Without and with gradient checkpointing, each in a fresh subprocess:

1. build the model and the optimizer; one warm-up step creates Adam's m and v and the
   gradients, which stay allocated (``zero_grad(set_to_none=False)``) as ZeRO's flat gradient
   partition does;
2. reset the peak resident memory (``/proc/self/clear_refs``) and run a second step: its peak
   above the memory before it (``transient``: the activations and the head in backward, or the
   optimizer step's temporary, whichever is larger) and above the process before the model
   (``total``: plus weights, gradients, m and v, 16 bytes per parameter).

The subprocesses run with glibc's mmap threshold fixed at 64 KiB, so a freed tensor's pages go
back to the system at once and the resident peak is the live bytes' peak (not a heap that kept
freed blocks). The estimate is the model's formula for the same shape, dtype (4 bytes) and
token count; the check passes when every ratio is within ``--tolerance`` (15%) of 1.

    DS_ACCELERATOR=cpu python -m benchmarks.check_memory_model [--tokens 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPE = dict(
    num_params=0,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    vocab_size=49152,
)
ROW_TOKENS = 256  # tokens per packed row: 16 prompt + 240 response
PROMPT = 16
GIB = float(1 << 30)


def _status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def child(tokens: int, checkpointing: bool, chunk: int) -> dict:
    """One measured step in this process (run with --child); returns bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bandpo.actor.attention import use_packed_attention
    from bandpo.actor.logprobs import packed_logprobs
    from bandpo.actor.packing import pack_rows

    start = _status_kib("VmRSS") * 1024
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SHAPE["vocab_size"],
        hidden_size=SHAPE["hidden_size"],
        intermediate_size=SHAPE["intermediate_size"],
        num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_kv_heads"],
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).train()
    if not use_packed_attention(model):
        raise RuntimeError("the model did not take the packed attention (its attention is not sdpa)")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, foreach=True)
    rows = tokens // ROW_TOKENS
    ids = torch.randint(3, SHAPE["vocab_size"], (rows, ROW_TOKENS))
    ones = torch.ones(rows, ROW_TOKENS - PROMPT, dtype=torch.long)
    packed = pack_rows(ids[:, :PROMPT], torch.ones(rows, PROMPT, dtype=torch.long), ids[:, PROMPT:], ones)

    def step() -> None:
        logp, _ = packed_logprobs(model, packed, chunk=chunk)
        (-logp.sum() / logp.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()  # creates m, v and the gradients
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory restarts from the current one
    before = _status_kib("VmRSS") * 1024
    step()
    peak = _status_kib("VmHWM") * 1024
    params = sum(p.numel() for p in model.parameters())
    return {
        "params": params,
        "tokens": int(packed.input_ids.shape[1]),
        "transient": peak - before,
        "total": peak - start,
    }


def estimate(params: int, tokens: int, checkpointing: bool, chunk: int) -> dict:
    """The memory model's bytes for the measured step (fp32, one rank, foreach AdamW)."""
    from bandpo.distributed.footprint import (
        ModelShape,
        head_activation_bytes,
        head_transient_bytes,
        layers_activation_bytes,
        optimizer_step_bytes,
    )

    shape = ModelShape(**{**SHAPE, "num_params": params})
    backward = tokens * (
        layers_activation_bytes(shape, 4, checkpointing) + head_activation_bytes(shape, 4, True)
    ) + head_transient_bytes(shape, 4, chunk)
    step = optimizer_step_bytes(shape, 1, 2)
    transient = max(backward, step)
    return {
        "backward": backward,
        "optimizer_step": step,
        "transient": transient,
        "total": 16 * params + transient,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens in the step (rows of 256)")
    ap.add_argument(
        "--chunk", type=int, default=512, help="tokens per lm_head chunk (actor.logits_chunk_tokens)"
    )
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", choices=["plain", "checkpointing"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tokens < ROW_TOKENS or args.tokens % ROW_TOKENS:
        ap.error(f"--tokens must be a positive multiple of {ROW_TOKENS}")
    if args.child:
        print(json.dumps(child(args.tokens, args.child == "checkpointing", args.chunk)))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = []
    for mode in ("plain", "checkpointing"):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.check_memory_model",
            "--child",
            mode,
            "--tokens",
            str(args.tokens),
            "--chunk",
            str(args.chunk),
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"the {mode} measurement failed:\n{out.stderr[-3000:]}")
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        est = estimate(measured["params"], measured["tokens"], mode == "checkpointing", args.chunk)
        for what in ("transient", "total"):
            results.append(
                {
                    "mode": mode,
                    "what": what,
                    "measured_gib": measured[what] / GIB,
                    "estimated_gib": est[what] / GIB,
                    "ratio": est[what] / measured[what],
                    "params": measured["params"],
                    "tokens": measured["tokens"],
                    "backward_gib": est["backward"] / GIB,
                    "optimizer_step_gib": est["optimizer_step"] / GIB,
                }
            )
    print(f"{'mode':<14} {'peak':<10} {'measured GiB':>12} {'estimated GiB':>13} {'est/meas':>8}")
    for r in results:
        print(
            f"{r['mode']:<14} {r['what']:<10} {r['measured_gib']:>12.3f} {r['estimated_gib']:>13.3f} "
            f"{r['ratio']:>8.3f}"
        )
    ok = all(abs(r["ratio"] - 1) <= args.tolerance for r in results)
    report = {
        "ok": ok,
        "tolerance": args.tolerance,
        "chunk": args.chunk,
        "rows": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in results],
    }
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
