"""GPU smoke test and actor benchmark: everything one GPU machine can check without Ray or vLLM.

    .venv/bin/python -m bandpo.tools.gpu_smoke [--out gpu_smoke.json]   # CUDA: a random Qwen2.5-1.5B-shaped model
    .venv/bin/python -m bandpo.tools.gpu_smoke --cpu                      # the same code paths on a tiny model (CI)

Per ZeRO stage (2, 3), one DeepSpeed rank with a reference model (bf16 weights with fp32 master
weights and gradient checkpointing on GPU; fp32 on CPU), built, used and torn down in the trainer's
order of a step (reload, old and reference log-probs, update with the KL term, offload):
  reference  the reference model's log-probs before any update against the actor's (one model's two
             copies: within the packed bound, ``ref/old``), and again after the offload round trip took
             it to host memory and back (frozen: bit for bit, ``ref diff``)
  update     a first optimizer step (warm-up), then a timed one on ``--rows`` rows in groups of 4
             that share a prompt (the shared-prompt packing of GRPO's groups): actor tokens/s and
             MFU = 6 x params x tokens / time / peak (``PEAK_FLOPS`` by exact device name)
  memory     the timed update's peak (GPU: allocated; CPU: resident set above the process before
             the actor was built) against the placement plan's ``actor_peak`` for this shape
             (``bandpo.distributed.memory.memory_estimate``)
  offload    after the first optimizer step, ``ActorOffload`` (what ``actor.offload_during_rollout``
             does around a rollout): offload, offload_weights, reload, then every weight, master
             weight and Adam state compared with before (max |delta|, 0 expected), the memory
             it freed, and the pinned host memory it took (GPU: torch's pinned allocator, blocks
             rounded up to powers of two) against the plan's (``bandpo.distributed.host_memory``);
             the timed update then runs on the reloaded states
  packed     the padding-free path (packed attention, shared prompts, chunked lm_head) against the
             padded reference with full logits: max |delta log-prob| vs ``logprob_tolerance``
  teardown   ``Actor.close``: whether the model was freed, and the memory still allocated after it
             (GPU), before the next stage
Per ZeRO stage (2, 3) again, with LoRA adapters (``--lora-rank``, every target), bf16 (on the CPU too),
gradient checkpointing and offload, in the trainer's order of a step and a checkpoint:
  update     two optimizer steps; the peak of the second against the plan's ``actor_peak`` with LoRA;
             the dtypes of the factors, of the frozen base and of DeepSpeed's master copy
             (bf16, bf16, fp32 expected)
  offload    ``offload`` then ``offload_weights`` (stage 7: after the sync has read the weights)
  save       ``save_checkpoint`` and the adapter export while the weights are in host memory
             (stage 8); the adapter file's dtype and values against the factors (exact)
  load       a new actor, built offloaded as a resumed run's, loads the checkpoint: factors, master
             weights and Adam's moments (exact), and its log-probs against the first actor's (exact)
  reload     the first actor's own states back from host memory (exact)
A failure is recorded in its row (the phase and the error, with what was measured before it) and the
next stage runs, so one run reports every stage.
Once (GPU only):
  ipc        the CUDA IPC bucket round trip of the weights into another process
             (``bandpo.weight_sync.ipc``), GB/s, next to the device's own copy bandwidth
Prints one table and writes JSON (load average included). Nothing here is a timed assertion.
The checks themselves are in ``bandpo.tools.gpu_smoke.checks`` and ``.lora``; ``scripts/gpu_smoke.py``
runs this module.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from bandpo.tools.gpu_smoke.checks import GROUP, check_stage, ipc_round_trip
from bandpo.tools.gpu_smoke.lora import check_lora, lora_table, workdir_of

# Dense (no sparsity) bf16 tensor-core peaks in FLOP/s with fp32 accumulation, from the vendor's
# datasheets, keyed by the exact torch.cuda.get_device_name(): an unknown name reports no MFU
# rather than a guess (give --peak-tflops).
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989.5e12,  # SXM5
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H800": 989.5e12,  # SXM5
    "NVIDIA H800 PCIe": 756.5e12,
    "NVIDIA H200": 989.5e12,  # SXM5
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA GH200 480GB": 989.5e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A10": 125e12,
    "NVIDIA L40S": 362.05e12,
    "NVIDIA L40": 181.05e12,
    "NVIDIA L4": 121e12,
    "NVIDIA GeForce RTX 4090": 165.2e12,
}
QWEN25_1_5B = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    vocab_size=151936,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=256,
    vocab_size=512,
    tie_word_embeddings=True,
)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named exactly ``device_name`` (None: not in ``PEAK_FLOPS``, e.g. a CPU)."""
    return PEAK_FLOPS.get(device_name)


def build_model(folder: Path, shape: dict, dtype) -> int:
    """A randomly initialised Qwen2 of ``shape`` saved to ``folder``; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=32768)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


COLUMNS = (  # header, key, format
    ("ZeRO", "zero_stage", "4d"),
    ("update s", "update_s", "9.2f"),
    ("tokens/s", "tokens_per_s", "10.0f"),
    ("MFU", "mfu", "6.3f"),
    ("peak GiB", "peak_gib", "9.2f"),
    ("est GiB", "estimate_gib", "8.2f"),
    ("peak/est", "peak_over_estimate", "9.2f"),
    ("packed err", "packed_max_err", "11.2e"),
    ("tol", "packed_tol", "9.2e"),
    ("offload diff", "offload_max_diff", "13.2e"),
    ("freed GiB", "offload_freed_gib", "10.2f"),
    ("pinned GiB", "pinned_gib", "11.2f"),
    ("pin plan", "pinned_plan_gib", "9.2f"),
    ("ref/old", "ref_first_diff", "9.2e"),
    ("ref diff", "ref_reload_diff", "9.2e"),
    ("left GiB", "left_after_close_gib", "9.2f"),
)


def table(rows: list[dict], ipc: dict | None) -> str:
    def cell(v, spec):
        width = int(spec.rstrip("dfe").split(".")[0])
        return "-".rjust(width) if v is None else format(v, spec)

    lines = [" ".join(h.rjust(int(spec.rstrip("dfe").split(".")[0])) for h, _, spec in COLUMNS)]
    lines += [" ".join(cell(r.get(key), spec) for _, key, spec in COLUMNS) for r in rows]
    lines += [f"ZeRO-{r['zero_stage']} failed at {r['error']}" for r in rows if r.get("error")]
    lines += [
        f"ZeRO-{r['zero_stage']}: no estimate ({r['estimate_error']})"
        for r in rows
        if r.get("estimate_error")
    ]
    if ipc and "error" in ipc:
        lines.append(f"IPC round trip failed: {ipc['error']}")
    elif ipc:
        lines.append(
            f"IPC round trip: {ipc['ipc_bytes'] / 1e9:.2f} GB in {ipc['ipc_buckets']} buckets, "
            f"{ipc['ipc_gbs']:.1f} GB/s = {ipc['ipc_over_copy']:.2f} x the device copy "
            f"({ipc['device_copy_gbs']:.1f} GB/s)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU, fp32 (the CI mode)")
    ap.add_argument(
        "--rows", type=int, default=None, help=f"rows per update, groups of {GROUP} (default 16 GPU, 8 CPU)"
    )
    ap.add_argument("--prompt", type=int, default=None, help="max prompt tokens (default 512 GPU, 16 CPU)")
    ap.add_argument(
        "--response", type=int, default=None, help="max response tokens (default 1536 GPU, 24 CPU)"
    )
    ap.add_argument(
        "--token-budget", type=int, default=None, help="packed tokens per micro-batch (default 32768)"
    )
    ap.add_argument(
        "--no-grad-ckpt",
        dest="grad_ckpt",
        action="store_false",
        default=None,
        help="no gradient checkpointing (default: on for GPU, off for CPU)",
    )
    ap.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak of a GPU not in PEAK_FLOPS"
    )
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--lora-stages", default="2,3", help="ZeRO stages of the LoRA check ('' skips it)")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default 64 GPU, 8 CPU)")
    ap.add_argument("--no-ipc", dest="ipc", action="store_false", help="skip the CUDA IPC round trip")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bandpo-gpu-smoke"))
    ap.add_argument("--out", default="gpu_smoke.json")
    args = ap.parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cpu" if args.cpu else "cuda"  # before DeepSpeed is imported
    small = args.cpu
    args.rows = args.rows or (8 if small else 16)
    args.prompt = args.prompt or (16 if small else 512)
    args.response = args.response or (24 if small else 1536)
    args.token_budget = args.token_budget or 32768
    args.lora_rank = args.lora_rank or (8 if small else 64)
    # A Qwen2.5-1.5B shape's 20k tokens in one micro-batch need ~60 GiB of activations without
    # checkpointing: on by default for the GPU, as the real model configs set it.
    args.grad_ckpt = (not small) if args.grad_ckpt is None else args.grad_ckpt
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_smoke: no CUDA device; run with --cpu for the CPU-capable parts")
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    args.peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device)
    if not args.cpu and args.peak is None:
        print(f"gpu_smoke: {device!r} is not in PEAK_FLOPS; no MFU (give --peak-tflops)")
    shape = TINY if small else QWEN25_1_5B
    dtype = "float32" if args.cpu else "bfloat16"
    model_dir = Path(args.workdir) / ("tiny" if small else "qwen2.5-1.5b-random")
    params = build_model(model_dir, shape, getattr(torch, dtype))
    rows = []
    for stage in filter(
        None, args.stages.split(",")
    ):  # each row printed as it comes: a run cut short still reports
        rows.append(check_stage(str(model_dir), int(stage), args, shape, params, dtype))
        print(json.dumps(rows[-1]), flush=True)
    lora_rows = []
    for stage in filter(None, args.lora_stages.split(",")):
        lora_rows.append(check_lora(str(model_dir), int(stage), args, shape, params, workdir_of(args)))
        print(json.dumps(lora_rows[-1]), flush=True)
    try:
        ipc = ipc_round_trip(str(model_dir)) if not args.cpu and args.ipc else None
    except Exception as e:  # recorded: the table and the JSON still come out
        ipc = {"error": f"{type(e).__name__}: {e}"}
    print(
        f"device {device}   model {params / 1e6:.1f}M params ({dtype})   rows {args.rows} "
        f"(groups of {GROUP})   gradient checkpointing {args.grad_ckpt}   load average {os.getloadavg()}"
    )
    print(table(rows, ipc))
    if lora_rows:
        print(lora_table(lora_rows))
    result = {
        "meta": {
            "device": device,
            "params": params,
            "dtype": dtype,
            "machine": platform.machine(),
            "peak_flops": args.peak,
            "load_avg": os.getloadavg(),
            "args": vars(args),
        },
        "stages": rows,
        "lora": lora_rows,
        "ipc": ipc,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result
