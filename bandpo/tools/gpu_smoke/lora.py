"""The LoRA check of ``python -m bandpo.tools.gpu_smoke`` (its docstring says what is measured): one ZeRO stage's
actor with LoRA adapters, bf16, gradient checkpointing and offload, taken through the trainer's order
of a step and a checkpoint (``check_lora``), and its table (``lora_table``)."""

from __future__ import annotations

import gc
import os
import traceback
import weakref
from pathlib import Path

from bandpo.tools.gpu_smoke.checks import PeakMemory, computed_tokens, estimate_or_error, random_batch


def lora_states(actor) -> dict:
    """CPU copies of what a LoRA checkpoint must bring back, by name: the adapter factors (gathered
    under ZeRO-3), the optimizer's fp32 master partitions and Adam's moments."""
    import torch

    from bandpo.lora_weights import lora_factors

    module, opt = actor.engine.module, actor.engine.optimizer
    names = [n for n, _ in module.named_parameters() if ".lora_" in n]
    factors = lora_factors(module)
    with actor._gathered(factors):
        out = {n: p.detach().to("cpu", copy=True) for n, p in zip(names, factors)}
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
    out.update({f"master.{i}": t.detach().to("cpu", copy=True) for i, t in enumerate(masters)})
    for i, state in enumerate(opt.optimizer.state.values()):
        for key, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[f"adam.{i}.{key}"] = v.to("cpu", copy=True)
    return out


def max_diff(before: dict, after: dict) -> float:
    """Max |delta| over tensors of the same names; a name, shape or dtype that differs raises naming it."""
    import torch

    if list(before) != list(after):
        missing = sorted(set(before) ^ set(after))
        raise RuntimeError(f"{len(before)} tensors before, {len(after)} after; differing: {missing[:3]}")
    worst = 0.0
    for name, a in before.items():
        b = after[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise RuntimeError(f"{name}: {a.dtype} {tuple(a.shape)} before, {b.dtype} {tuple(b.shape)} after")
        if not torch.equal(a, b):
            worst = max(worst, float((a.float() - b.float()).abs().max()))
    return worst


def dtypes(tensors) -> str:
    """The dtypes of ``tensors`` as one short string ("bf16", "fp32", "bf16+fp32")."""
    short = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}
    return "+".join(sorted({short.get(str(t.dtype), str(t.dtype)) for t in tensors}))


def check_lora(model_dir: str, stage: int, args, shape: dict, params: int, workdir: Path) -> dict:
    """LoRA at ``stage``: update, offload, weights offloaded, save (checkpoint and adapter) from host
    memory, load into a new actor, exact compare. A failure is recorded in the row (``error``, with the
    phase it happened in) with what was measured before it; it never raises."""
    out: dict = {"zero_stage": stage, "lora_rank": args.lora_rank, "phase": "build"}
    refs: list = []  # weak references to the actors' modules: freed once closed
    try:
        _run(out, model_dir, stage, args, shape, params, workdir, refs)
    except Exception as e:  # recorded; the next stage runs
        out["error"] = f"{out['phase']}: {type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        import torch

        gc.collect()
        if not args.cpu:
            torch.cuda.empty_cache()
    out["freed_after_close"] = all(r() is None for r in refs) if refs else None
    return out


def _actor(model_dir: str, stage: int, args, refs: list):
    from bandpo.actor import Actor
    from bandpo.actor.lora import LoraSettings
    from bandpo.actor.offload import ActorOffload

    cuda = not args.cpu
    actor = Actor(
        model_dir,
        zero_stage=stage,
        bf16=True,
        mini_batch_size=args.rows,
        micro_batch_size=args.rows,
        lr=1e-3,
        max_tokens_per_micro_batch=args.token_budget,
        logprob_token_budget=args.token_budget,
        gradient_checkpointing=True,
        offload_during_rollout=cuda,
        # the export writes the adapter alone: the check reads it back
        lora=LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank, export="adapter"),
    )
    if actor.offloader is None:  # CPU: the trainer never offloads there, the code path runs all the same
        actor.offloader = ActorOffload(actor.engine, actor.ref, stage, actor.device)
        actor.offload()
        actor.offload_weights()
    refs.append(weakref.ref(actor.engine.module))
    return actor


def _run(out, model_dir, stage, args, shape, params, workdir: Path, refs: list) -> None:
    import torch
    from safetensors.torch import load_file

    from bandpo.algo.options import LossOptions
    from bandpo.checkpoint.lora_adapter import ADAPTER_WEIGHTS, adapter_path
    from bandpo.lora_weights import lora_factors
    from bandpo.types import TrainBatch

    cuda = not args.cpu
    rb = random_batch(args.rows, args.prompt, args.response, shape["vocab_size"])
    loss = LossOptions(
        algorithm="bandpo", divergence="kl", delta=0.05, upper_cap=10.0, agg="seq-mean-token-mean"
    )
    baseline = PeakMemory.live_rss()
    actor = _actor(model_dir, stage, args, refs)
    try:
        out["phase"] = "update"
        actor.reload()  # built offloaded, as before a first rollout
        old, _ = actor.compute_logprobs(rb)
        batch = TrainBatch.from_rollout(rb, advantages=torch.linspace(-1, 1, args.rows), old_logprobs=old)
        actor.update(batch, loss)  # warm-up: Adam's states allocated by a real step
        with PeakMemory(cuda, baseline) as peak:
            m = actor.update(batch, loss)
        tokens = computed_tokens(rb)
        module, opt = actor.engine.module, actor.engine.optimizer
        masters = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
        out.update(
            update_s=m["time_s"],
            tokens=tokens,
            peak_gib=peak.peak_gib,
            adapter_dtype=dtypes(lora_factors(module)),
            base_dtype=dtypes(p for n, p in module.named_parameters() if ".lora_" not in n),
            master_dtype=dtypes(masters),
        )
        out["estimate_gib"], out["estimate_error"] = estimate_or_error(
            params, shape, stage, args, bf16=True, lora_rank=args.lora_rank, grad_ckpt=True
        )
        est = out["estimate_gib"]
        out["peak_over_estimate"] = None if not est else out["peak_gib"] / est
        before = lora_states(actor)
        lp_before, _ = actor.compute_logprobs(rb)

        out["phase"] = "offload"  # stage 7: the states leave, the sync reads the weights, then they go too
        actor.offload()
        actor.offload_weights()
        out["weights_offloaded"] = actor.offloader.weights_offloaded

        out["phase"] = "save"  # stage 8: the checkpoint and the adapter written from host memory
        folder = workdir / f"lora-zero{stage}"
        actor.save_checkpoint(str(folder / "actor"), {"step": 1})
        actor.export_hf(str(folder / "hf"))
        file = load_file(str(adapter_path(folder / "hf") / ADAPTER_WEIGHTS))
        out["file_dtype"] = dtypes(file.values())
        factors = {k: v for k, v in before.items() if ".lora_" in k}
        named = {k.replace(".default.weight", ".weight"): v for k, v in factors.items()}
        out["file_max_diff"] = max_diff(dict(sorted(named.items())), dict(sorted(file.items())))

        out["phase"] = "load"  # a new actor (offloaded, as a resumed run's) loads the checkpoint
        fresh = _actor(model_dir, stage, args, refs)
        try:
            client = fresh.load_checkpoint(str(folder / "actor"))
            if client != {"step": 1}:
                raise RuntimeError(f"the checkpoint's client state came back as {client}")
            fresh.reload()
            out["load_max_diff"] = max_diff(before, lora_states(fresh))
            out["load_states"] = len(before)
            lp_fresh, _ = fresh.compute_logprobs(rb)
            out["load_logprob_diff"] = float((lp_fresh - lp_before).abs().max())
        finally:
            fresh.close()
            del fresh
        out["phase"] = "reload"  # and the offloaded actor itself comes back whole
        actor.reload()
        out["offload_max_diff"] = max_diff(before, lora_states(actor))
        out["ok"] = (
            out["adapter_dtype"] == out["base_dtype"] == out["file_dtype"] == "bf16"
            and out["master_dtype"] == "fp32"
            and out["file_max_diff"] == out["load_max_diff"] == out["offload_max_diff"] == 0.0
            and out["load_logprob_diff"] == 0.0
        )
        out["phase"] = "done"
    finally:
        actor.close()
        del actor


LORA_COLUMNS = (  # header, key, width, format (None: a string)
    ("ZeRO", "zero_stage", 4, "d"),
    ("rank", "lora_rank", 4, "d"),
    ("update s", "update_s", 9, ".2f"),
    ("peak GiB", "peak_gib", 9, ".2f"),
    ("est GiB", "estimate_gib", 8, ".2f"),
    ("peak/est", "peak_over_estimate", 9, ".2f"),
    ("adapter", "adapter_dtype", 8, None),
    ("base", "base_dtype", 5, None),
    ("master", "master_dtype", 6, None),
    ("file", "file_dtype", 5, None),
    ("offl'd", "weights_offloaded", 6, None),
    ("file diff", "file_max_diff", 10, ".2e"),
    ("load diff", "load_max_diff", 10, ".2e"),
    ("logp diff", "load_logprob_diff", 10, ".2e"),
    ("offl diff", "offload_max_diff", 10, ".2e"),
    ("ok", "ok", 5, None),
)


def lora_table(rows: list[dict]) -> str:
    """The LoRA rows as a table, then one line per row that failed (its phase and error)."""

    def cell(v, width, spec):
        if v is None:
            return "-".rjust(width)
        return (str(v) if spec is None else format(v, spec)).rjust(width)

    lines = ["LoRA (bf16, gradient checkpointing, offload):"]
    lines += ["      " + " ".join(h.rjust(w) for h, _, w, _ in LORA_COLUMNS)]
    lines += ["      " + " ".join(cell(r.get(k), w, s) for _, k, w, s in LORA_COLUMNS) for r in rows]
    lines += [f"LoRA ZeRO-{r['zero_stage']} failed at {r['error']}" for r in rows if r.get("error")]
    lines += [
        f"LoRA ZeRO-{r['zero_stage']}: no estimate ({r['estimate_error']})"
        for r in rows
        if r.get("estimate_error")
    ]
    return "\n".join(lines)


def workdir_of(args) -> Path:
    path = Path(args.workdir) / "lora"
    os.makedirs(path, exist_ok=True)
    return path
