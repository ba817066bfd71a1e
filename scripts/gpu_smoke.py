"""GPU smoke test and actor benchmark: everything one GPU machine can check without Ray or vLLM.

    .venv/bin/python scripts/gpu_smoke.py [--out gpu_smoke.json]   # CUDA: a random Qwen2.5-1.5B-shaped model
    .venv/bin/python scripts/gpu_smoke.py --cpu                      # the CPU-capable parts on a tiny model (CI)

Per ZeRO stage (2, 3), one DeepSpeed rank (bf16 weights with fp32 master weights on GPU, fp32 on CPU):
  packed     the padding-free path (packed attention + chunked lm_head) against the padded reference
             with full logits, max |delta log-prob| over response tokens vs ``logprob_tolerance``
  update     one optimizer step on ``--rows`` rows: actor tokens/s and MFU = 6 x params x tokens /
             time / peak (``PEAK_FLOPS`` by device name: 989e12 dense bf16 on an H100)
  memory     peak GPU memory allocated vs the placement plan's estimate for this shape
             (``bandpo.distributed.plan.memory_estimate``)
  offload    the same update after DeepSpeed's ``offload_states()`` / ``reload_states()`` (what
             ``actor.offload_during_rollout`` does around the rollout): max |delta weight| vs no offload
Once (GPU only):
  ipc        the CUDA IPC bucket round trip of the weights into another process
             (``bandpo.weight_sync.ipc``), GB/s, next to the device's own copy bandwidth
Prints a table and writes JSON (load average included). Nothing here is a timed assertion.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Dense bf16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name().
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
              "A10G": 125e12, "L4": 121e12, "4090": 165e12}
QWEN25_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                   intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=256, vocab_size=512, tie_word_embeddings=True)
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (None: not in ``PEAK_FLOPS``, e.g. a CPU)."""
    return next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)


def mfu(params: int, tokens: int, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of a training step: 6 x params x tokens (forward 2, backward 4) / time / peak."""
    return None if peak is None else 6.0 * params * tokens / seconds / peak


def logprob_tolerance(dtype: str, max_abs_logit: float, layers: int, hidden: int) -> float:
    """Max |delta log-prob| expected between two kernels' orderings of the same network in ``dtype``.

    A log-prob z_y - logsumexp(z) moves by at most 2 max|delta z|. Each layer ends in a rounding
    of the residual stream to ``dtype`` (unit roundoff u: 2^-8 bf16, 2^-24 fp32) where the two
    paths may round apart by one unit; over L layers, 2 roundings each, those differences add
    like a random walk: |delta z| ~ u (1 + max|z|) sqrt(2L). In fp32 the roundings of the
    H-term dot products (accumulation order differs between kernels) dominate instead: a further
    factor sqrt(H). bf16 GEMMs accumulate in fp32, so that factor does not apply there.
    """
    u = UNIT_ROUNDOFF[dtype]
    accumulate = math.sqrt(hidden) if dtype == "float32" else 1.0
    return 2.0 * u * (1.0 + max_abs_logit) * math.sqrt(2 * layers) * accumulate


def build_model(folder: Path, shape: dict, dtype) -> int:
    """A randomly initialised Qwen2 of ``shape`` saved to ``folder``; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=32768)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def random_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """``rows`` random rollouts, lengths up to ``prompt`` / ``response`` tokens (a group of 4 per prompt)."""
    import torch

    from bandpo.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)

    def ids(hi):
        n = int(torch.randint(hi // 2, hi + 1, (1,), generator=g))
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prompts = [ids(prompt) for _ in range(max(rows // 4, 1)) for _ in range(4)][:rows]
    responses = [ids(response) for _ in range(rows)]
    return RolloutBatch.from_lists(prompts, responses, [[0.0] * len(r) for r in responses],
                                   [i // 4 for i in range(rows)], ["stop"] * rows, pad_id=0)


def plan_estimate(params: int, shape: dict, stage: int, rows: int, token_budget: int, max_len: int) -> dict | None:
    """The placement plan's per-GPU memory estimate (GiB) for this model on one colocated GPU."""
    from bandpo.config import compose
    from bandpo.distributed.plan import ClusterShape, make_plan, memory_estimate

    cfg = compose([
        "model=qwen2.5-3b", f"model.num_params={params}", f"model.hidden_size={shape['hidden_size']}",
        f"model.num_layers={shape['num_hidden_layers']}", f"model.vocab_size={shape['vocab_size']}",
        f"model.max_model_len={max_len}", "model.gradient_checkpointing=false", "actor.gradient_checkpointing=false",
        "actor.num_workers=1", "rollout.num_workers=1", f"actor.zero_stage={stage}", f"actor.micro_batch_size={rows}",
        f"actor.max_tokens_per_micro_batch={token_budget}", "algorithm.kl_coef=0",
    ])
    return memory_estimate(cfg, make_plan(cfg, ClusterShape(1, 1), "cuda"))


def check_stage(model_dir: str, stage: int, args, shape: dict, params: int, dtype: str) -> dict:
    """packed / update / memory / offload for one ZeRO stage (see the module docstring)."""
    import torch

    from bandpo.actor import Actor
    from bandpo.algo.losses import LossOptions
    from bandpo.types import TrainBatch

    cuda = not args.cpu
    rb = random_batch(args.rows, args.prompt, args.response, shape["vocab_size"])
    common = dict(zero_stage=stage, bf16=cuda, mini_batch_size=args.rows, micro_batch_size=args.rows, lr=1e-5,
                  max_tokens_per_micro_batch=args.token_budget, logprob_token_budget=args.token_budget)
    loss = LossOptions(algorithm="bandpo", divergence="kl", delta=0.05, upper_cap=10.0, agg="seq-mean-token-mean")
    out: dict = {"zero_stage": stage}
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def train_once(offload: bool) -> tuple[dict, dict]:
        actor = Actor(model_dir, **common)
        old, _ = actor.compute_logprobs(rb)
        batch = TrainBatch.from_rollout(rb, advantages=torch.linspace(-1, 1, args.rows), old_logprobs=old)
        if offload:  # as around a rollout: optimizer states and weights to host memory and back
            actor.engine.offload_states()
            actor.engine.reload_states()
        metrics = actor.update(batch, loss)
        weights = {n: t for b in actor.named_weights() for n, t in b}
        return {"actor": actor, "old": old, "metrics": metrics}, weights

    run, weights = train_once(offload=False)
    actor = run["actor"]
    # Timed: a second update on the same rows (the first one pays for kernel selection and warm-up).
    batch = TrainBatch.from_rollout(rb, advantages=torch.linspace(-1, 1, args.rows), old_logprobs=run["old"])
    m = actor.update(batch, loss)
    tokens = int(rb.prompt_mask.sum() + rb.response_mask.sum())  # tokens through the forward and backward
    out.update(update_s=m["time_s"], tokens=tokens, tokens_per_s=tokens / m["time_s"],
               mfu=mfu(params, tokens, m["time_s"], peak_flops(torch.cuda.get_device_name()) if cuda else None))
    if cuda:
        est = plan_estimate(params, shape, stage, args.rows, args.token_budget, args.prompt + args.response)
        out.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30, estimate_gib=est["actor_total"])

    # packed attention + chunked head vs the padded reference with full logits, same weights
    actor.padding_free, actor.share_prompts = False, False
    padded, _ = actor.compute_logprobs(rb)
    actor.padding_free, actor.share_prompts = True, True
    packed, _ = actor.compute_logprobs(rb)
    mask = rb.response_mask.bool()
    # The largest |log p| stands in for max|z|: log-softmax is shift-invariant, and z_max - z_y <= -log p_y.
    logits_max = float(padded[mask].abs().max())
    out["packed_max_err"] = float((packed - padded)[mask].abs().max())
    out["packed_tol"] = logprob_tolerance(dtype, logits_max, shape["num_hidden_layers"], shape["hidden_size"])
    out["packed_ok"] = out["packed_max_err"] <= out["packed_tol"]
    del run, actor
    if cuda:
        torch.cuda.empty_cache()
        _, offloaded = train_once(offload=True)
        out["offload_max_diff"] = max(float((weights[k].float() - offloaded[k].float()).abs().max()) for k in weights)
    return out


def _ipc_receiver(inbox, outbox) -> None:
    import torch

    from bandpo.weight_sync.ipc import open_ipc_bucket

    while (msg := inbox.get()) is not None:
        uuid, payload = msg
        for _, view in open_ipc_bucket({uuid: payload}):
            torch.empty_like(view).copy_(view)  # the engine's load: one copy out of the bucket
        torch.cuda.synchronize()
        outbox.put(True)


def ipc_round_trip(model_dir: str, bucket_bytes: int = 256 << 20) -> dict:
    """GB/s of packing the model's weights into IPC buckets and copying them out in another process."""
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from bandpo.weight_sync.ipc import pack_ipc_bucket

    weights = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().named_parameters())
    buckets, cur, size = [], [], 0
    for name, p in weights:
        if cur and size + p.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, p.detach()))
        size += p.nbytes
    buckets.append(cur)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(inbox, outbox))
    proc.start()
    total = sum(p.nbytes for _, p in weights)

    def one_pass() -> float:
        t0 = time.perf_counter()
        for bucket in buckets:
            uuid, payload, buf = pack_ipc_bucket(bucket)
            inbox.put((uuid, payload))
            outbox.get(timeout=300)
            del buf
        return time.perf_counter() - t0

    one_pass()  # warm-up: the receiver's CUDA context and IPC mappings
    seconds = min(one_pass() for _ in range(3))
    inbox.put(None)
    proc.join()
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    copy_gbs = 5 * a.nbytes / (time.perf_counter() - t0) / 1e9
    ipc_gbs = total / seconds / 1e9
    return {"ipc_bytes": total, "ipc_buckets": len(buckets), "ipc_s": seconds, "ipc_gbs": ipc_gbs,
            "device_copy_gbs": copy_gbs, "ipc_over_copy": ipc_gbs / copy_gbs}


def table(rows: list[dict], ipc: dict | None) -> str:
    def f(v, spec):  # spec: width, then format
        width = int(spec.split(".")[0])
        return "-".rjust(width) if v is None else format(v, spec)

    lines = [f"{'ZeRO':>4} {'update s':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'est GiB':>8} "
             f"{'packed err':>11} {'tol':>9} {'offload diff':>13}"]
    for r in rows:
        lines.append(f"{r['zero_stage']:>4} {r['update_s']:9.2f} {r['tokens_per_s']:10.0f} {f(r['mfu'], '6.3f')} "
                     f"{f(r.get('peak_gib'), '9.2f')} {f(r.get('estimate_gib'), '8.2f')} "
                     f"{r['packed_max_err']:11.2e} {r['packed_tol']:9.2e} {f(r.get('offload_max_diff'), '13.2e')}")
    if ipc:
        lines.append(f"IPC round trip: {ipc['ipc_bytes'] / 1e9:.2f} GB in {ipc['ipc_buckets']} buckets, "
                     f"{ipc['ipc_gbs']:.1f} GB/s = {ipc['ipc_over_copy']:.2f} x the device copy "
                     f"({ipc['device_copy_gbs']:.1f} GB/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU, fp32 (the CI mode)")
    ap.add_argument("--rows", type=int, default=None, help="rows per update (default 16 GPU, 4 CPU)")
    ap.add_argument("--prompt", type=int, default=None, help="max prompt tokens (default 512 GPU, 16 CPU)")
    ap.add_argument("--response", type=int, default=None, help="max response tokens (default 1536 GPU, 24 CPU)")
    ap.add_argument("--token-budget", type=int, default=None, help="packed tokens per micro-batch (default 32768)")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bandpo-gpu-smoke"))
    ap.add_argument("--out", default="gpu_smoke.json")
    args = ap.parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cpu" if args.cpu else "cuda"  # before DeepSpeed is imported
    small = args.cpu
    args.rows = args.rows or (4 if small else 16)
    args.prompt = args.prompt or (16 if small else 512)
    args.response = args.response or (24 if small else 1536)
    args.token_budget = args.token_budget or 32768
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_smoke: no CUDA device; run with --cpu for the CPU-capable parts")
    shape = TINY if small else QWEN25_1_5B
    dtype = "float32" if args.cpu else "bfloat16"
    model_dir = Path(args.workdir) / ("tiny" if small else "qwen2.5-1.5b-random")
    params = build_model(model_dir, shape, getattr(torch, dtype))
    rows = [check_stage(str(model_dir), int(s), args, shape, params, dtype) for s in args.stages.split(",")]
    ipc = None if args.cpu else ipc_round_trip(str(model_dir))
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    print(f"device {device}   model {params / 1e6:.1f}M params ({dtype})   rows {args.rows}   "
          f"load average {os.getloadavg()}")
    print(table(rows, ipc))
    result = {"meta": {"device": device, "params": params, "dtype": dtype, "machine": platform.machine(),
                       "load_avg": os.getloadavg(), "args": vars(args)},
              "stages": rows, "ipc": ipc}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
