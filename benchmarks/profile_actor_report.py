"""The analysis and tables of benchmarks/profile_actor.py (its docstring describes the run): torch.profiler's
events grouped into kinds of work by stage (``classify``, ``aggregate``), and the printed report. Pure Python:
the events are read through their attributes only (name, input_shapes, cpu_parent, time_range), so hand-made
ones test it.

Kinds of an outermost aten op: model matmuls (mm, addmm, bmm, matmul, linear, ...), lm_head matmuls (a
matmul with a dimension of the vocabulary size), attention (SDPA / flash kernels), elementwise (arithmetic,
norms, activations, softmax, reductions), cast/copy (aten::to / _to_copy / copy_), optimizer/ZeRO (every op
of the stages grad_norm, adamw, ds_step, zero_grads: DeepSpeed's flattening, casts and copies included, and
AdamW / foreach ops anywhere), other ops (embedding, indexing, cat, allocation); "outside ops" is a stage's
time in no aten op (Python, dispatch, the profiler's own).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

PREFIX = "stage::"  # the record_function names of the stages
KINDS = (
    "model matmul",
    "lm_head matmul",
    "attention",
    "elementwise",
    "cast/copy",
    "optimizer/ZeRO",
    "other ops",
)
COLUMNS = (*KINDS, "outside ops")
MATMULS = frozenset("mm addmm bmm baddbmm matmul linear addmv mv dot _addmm_activation".split())
CASTS = frozenset(("to", "_to_copy", "copy_"))
ELEMENTWISE = frozenset(
    "add sub rsub mul div neg pow rsqrt sqrt exp log silu sigmoid tanh gelu mean sum prod softmax log_softmax "
    "logsumexp where masked_fill clamp lerp addcdiv addcmul maximum minimum reciprocal cos sin abs sign".split()
)
OPTIMIZER_STAGES = frozenset(("zero_grads", "grad_norm", "adamw", "ds_step"))


def classify(name: str, shapes, stage: str, vocab: int) -> str:
    """The kind (``KINDS``) of an outermost aten op ``name`` with input ``shapes`` (lists of dims) run in
    ``stage``: every op of DeepSpeed's and the optimizer's stages is optimizer/ZeRO (their copies and casts
    too); a matmul with a dimension of ``vocab`` is the lm_head's."""
    if stage in OPTIMIZER_STAGES:
        return "optimizer/ZeRO"
    base = name.removeprefix("aten::")
    if base.rstrip("_") in MATMULS:  # in place too: the head's weight gradient is an addmm_
        head = any(isinstance(s, (list, tuple)) and vocab in s for s in shapes or ())
        return "lm_head matmul" if head else "model matmul"
    if "attention" in base or "flash" in base:
        return "attention"
    if base in CASTS:
        return "cast/copy"
    if "adam" in base or base.startswith("_foreach") or "flatten" in base:
        return "optimizer/ZeRO"
    core = base.strip("_").removesuffix("_backward_data").removesuffix("_backward")
    if core in ELEMENTWISE or "norm" in core or "softmax" in core:
        return "elementwise"
    return "other ops"


def _under_op(ev) -> bool:
    parent = ev.cpu_parent
    while parent is not None and not parent.name.startswith("aten::"):
        parent = parent.cpu_parent
    return parent is not None


def aggregate(events, vocab: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """({stage: {kind: seconds}}, {"op [kind]": seconds}) from torch.profiler's ``events`` (name,
    input_shapes, cpu_parent, time_range in us): each outermost aten op under the innermost stage whose range
    holds it (stages nest), and each stage's exclusive time in no op as "outside ops", so that the table adds
    up to the outermost stages' time."""
    table: dict = defaultdict(lambda: defaultdict(float))
    ops: dict = defaultdict(float)
    open_stages: list[tuple[float, str]] = []  # (end, name) of the stages holding the current event
    for ev in sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)):
        start, end = ev.time_range.start, ev.time_range.end
        while open_stages and open_stages[-1][0] <= start:
            open_stages.pop()
        stage, seconds = open_stages[-1][1] if open_stages else "(none)", (end - start) / 1e6
        if ev.name.startswith(PREFIX):
            table[ev.name[len(PREFIX) :]]["outside ops"] += seconds
            if open_stages:
                table[stage]["outside ops"] -= seconds
            open_stages.append((end, ev.name[len(PREFIX) :]))
        elif ev.name.startswith("aten::") and not _under_op(ev):
            kind = classify(ev.name, ev.input_shapes, stage, vocab)
            table[stage][kind] += seconds
            table[stage]["outside ops"] -= seconds
            ops[f"{ev.name} [{kind}]"] += seconds
    return {stage: dict(kinds) for stage, kinds in table.items()}, dict(ops)


def _gib(n) -> str:
    return f"{(n or 0) / 2**30:.2f}"


def print_report(r: dict) -> None:
    """The tables of one dtype's run (``profile_actor.profile``'s report)."""
    m, s, p, mem = r["machine"], r["settings"], r["matmul_peak"], r["memory"]
    flags = ", ".join(f for f, on in m["flags"].items() if on) or "none of them"
    print(
        f"\n{s['dtype']}, {s['source']} ({r['model']['params'] / 1e6:.1f}M params): {s['prompts']} prompts x "
        f"{s['samples']} x ({s['prompt_len']} + {s['response_len']}) tokens, {s['optimizer_steps']} optimizer "
        f"steps, update micro-batches of {s['update_micro_batch_tokens']} packed tokens, kl_coef {s['kl_coef']}\n"
        f"CPU: {m['cpu']}, {m['cpus']} CPUs, {m['torch_threads']} torch threads, flags: {flags}; load average "
        f"{m['load_average_start'][0]:.2f} at the start, {m['load_average'][0]:.2f} at the end; matmul peak "
        f"{p['flops_per_s'] / 1e9:.1f} GFLOP/s (torch.mm, {p['dtype']})"
    )
    head = "".join(f"{c[:11]:>12}" for c in COLUMNS)
    for name, ph in r["phases"].items():
        print(
            f"\n{name}: {ph['seconds']:.2f} s, {ph['tokens']} tokens, {ph['peak_frac']:.1%} of the matmul peak; "
            f"profiled {ph['profiled_seconds']:.2f} s, model matmuls {ph['model_matmul_share']:.1%} of it\n"
            f"{'stage':<14}{'timed s':>8}{'share':>7} | profiled s{head}"
        )
        for stage, sec in sorted(ph["stages"].items(), key=lambda x: -x[1]) + [("all", ph["seconds"])]:
            kinds = ph["kind_totals"] if stage == "all" else ph["kinds"].get(stage, {})
            cells = "".join(f"{kinds.get(c, 0.0):>12.3f}" for c in COLUMNS)
            label = "rest" if stage == name else stage
            print(f"{label:<14}{sec:>8.3f}{sec / ph['seconds']:>7.1%} |{'':>10}{cells}")
        shares = "".join(f"{ph['kind_totals'][c] / ph['profiled_seconds']:>12.1%}" for c in COLUMNS)
        top = ", ".join(f"{k} {v:.3f}" for k, v in list(ph["top_ops"].items())[:8])
        print(f"{'share of the profiled time':<29} |{'':>10}{shares}\ncostliest ops, profiled s: {top}")
    points = ", ".join(f"{k.removeprefix('rss_')} {_gib(v)}" for k, v in mem.items() if k.startswith("rss_"))
    print(f"\nmemory, GiB: RSS {points}; peak {_gib(mem['peak_rss'])} (VmHWM, before the profiled runs)")
    for name, ph in r["phases"].items():
        h = ph["heap_after"]
        print(
            f"  {name}: RSS {_gib(ph['rss_before'])} -> peak {_gib(ph['rss_peak'])} -> {_gib(ph['rss_after'])}; "
            f"heap after: in use {_gib(h.get('in_use'))}, freed but kept {_gib(h.get('free_kept'))}"
        )
    for key in (
        "held_at_rest",
        "held_in_step",
        "estimates",
        "heap_warm",
        "heap_end",
        "status_warm",
        "status_end",
    ):
        print(f"  {key.replace('_', ' ')}: " + ", ".join(f"{k} {_gib(v)}" for k, v in mem[key].items()))


def print_comparison(a: dict, b: dict) -> None:
    """fp32 (``a``) against bf16 (``b``): seconds, peak fractions, model-matmul shares, the update's kinds."""
    print(
        "\nfp32 against bf16, each in a fresh process, one after the other\n"
        f"{'phase':<14}{'fp32 s':>8}{'bf16 s':>8}{'ratio':>7}{'fp32 peak':>10}{'bf16 peak':>10}"
        f"{'fp32 mm':>8}{'bf16 mm':>8}"
    )
    for name, x in a["phases"].items():
        y = b["phases"][name]
        print(
            f"{name:<14}{x['seconds']:>8.2f}{y['seconds']:>8.2f}{x['seconds'] / y['seconds']:>6.2f}x"
            f"{x['peak_frac']:>10.1%}{y['peak_frac']:>10.1%}"
            f"{x['model_matmul_share']:>8.1%}{y['model_matmul_share']:>8.1%}"
        )
    x, y = (run["phases"]["update"] for run in (a, b))
    shares = "; ".join(
        f"{c} {x['kind_totals'][c] / x['profiled_seconds']:.1%} / {y['kind_totals'][c] / y['profiled_seconds']:.1%}"
        for c in COLUMNS
    )
    print(
        f"update, share of the profiled time by kind, fp32 / bf16: {shares}\n"
        f"matmul peak GFLOP/s {a['matmul_peak']['flops_per_s'] / 1e9:.1f} / "
        f"{b['matmul_peak']['flops_per_s'] / 1e9:.1f}; peak RSS GiB {_gib(a['memory']['peak_rss'])} / "
        f"{_gib(b['memory']['peak_rss'])}"
    )


def summarize(kinds: dict, ops: dict, seconds: float, top: int = 15) -> dict:
    """A profiled phase's fields from ``aggregate``'s output and its profiled ``seconds``: the kinds by stage,
    their totals, the model-matmul share of ``seconds`` and the ``top`` costliest ops."""
    totals = {k: sum(s.get(k, 0.0) for s in kinds.values()) for k in COLUMNS}
    return {
        "profiled_seconds": seconds,
        "kinds": kinds,
        "kind_totals": totals,
        "model_matmul_share": totals["model matmul"] / seconds,
        "top_ops": dict(sorted(ops.items(), key=lambda x: -x[1])[:top]),
    }


def machine() -> dict:
    """The CPU's name and its matmul-relevant flags (/proc/cpuinfo), this process's CPUs, the load average."""
    cpuinfo = Path("/proc/cpuinfo")
    first = cpuinfo.read_text().split("\n\n")[0] if cpuinfo.exists() else ""  # the first processor's block
    fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in first.splitlines())}
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", "unknown"),
        "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")},
        "cpus": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
    }
