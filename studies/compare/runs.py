"""The runs of the tiny-arith comparison, read for ``studies.compare.report``: the ``<label>-s<seed>/`` folders under
``--runs`` (``find_runs``), one run's numbers from its metrics.jsonl and config.yaml (``run_summary``),
a step-0 evaluation lent between runs that share it (``share_before``), and the settings the runs
share or not (``budget_check``)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from bandpo.viz import read_metrics

RUN_DIR = re.compile(r"^(?P<label>.+)-s(?P<seed>\d+)$")
EVAL_MEAN = re.compile(r"^eval/(?P<dataset>[^/]+)/(?P<metric>mean|maj|pass)@(?P<n>\d+)$")
# What must match for "equal budgets": only the algorithm and the seed may differ between runs.
BUDGET_KEYS = (
    "trainer.total_steps",
    "trainer.prompts_per_step",
    "rollout.n",
    "rollout.max_tokens",
    "rollout.temperature",
    "actor.lr",
    "actor.mini_batch_prompts",
    "actor.epochs",
    "model.path",
    "data.train",
    "eval.datasets",
    "eval.n",
    "eval.max_tokens",
)
# compare.sh runs these labels in this order; other labels found under --runs follow, sorted.
LABEL_ORDER = (
    "grpo",
    "clip_higher",
    "bandpo",
    "bandpo_d0.02",
    "bandpo_d0.1",
    "bandpo_filter",
    "bandpo_adaptive",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "cispo",
    "sapo",
    "bandpo_tv",
    "dcpo",
)


def find_runs(root: Path) -> dict[str, dict[int, Path]]:
    """``{label: {seed: run folder}}`` for the folders ``<label>-s<seed>`` under ``root`` with a metrics file."""
    runs: dict[str, dict[int, Path]] = {}
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        m = RUN_DIR.match(folder.name)
        if m and (folder / "metrics.jsonl").is_file():
            runs.setdefault(m["label"], {})[int(m["seed"])] = folder
    order = {label: i for i, label in enumerate(LABEL_ORDER)}
    return {
        label: dict(sorted(runs[label].items()))
        for label in sorted(runs, key=lambda s: (order.get(s, len(order)), s))
    }


def run_summary(folder: Path) -> dict:
    """One run's numbers: steps done and planned, eval before/after, entropy and response length by step,
    clip fractions, times, the actor's peak memory.

    "before" is the step-0 evaluation; "after" is the last evaluation logged after step 0
    (the final one of a finished run). ``clip`` holds the clip fractions and the token share
    of each old-probability bin, each the mean over the training steps.
    """
    rows = read_metrics(folder / "metrics.jsonl")
    train = [r for r in rows if "time/step" in r]
    evals = [r for r in rows if any(EVAL_MEAN.match(k) for k in r)]
    before = next((r for r in evals if r["step"] == 0), None)
    after = next((r for r in reversed(evals) if r["step"] > 0), None)
    clip_keys = [
        k for k in (train[0] if train else {}) if k.startswith(("actor/clip_frac", "actor/token_frac_bin"))
    ]
    cfg = _load_config(folder)
    start, end = run_times(folder)
    steps, total = (train[-1]["step"] if train else 0), _select(cfg, "trainer.total_steps")
    return {
        "folder": folder,
        "steps": steps,
        "total_steps": total,
        "finished": total is not None and steps >= total,
        "before": _eval_means(before),
        "after": _eval_means(after),
        "entropy": _number(train[-1].get("actor/entropy")) if train else None,
        "entropy_by_step": {r["step"]: _number(r.get("actor/entropy")) for r in train},
        "length_by_step": {r["step"]: _number(r.get("response/length_mean")) for r in train},
        "clip": {k.removeprefix("actor/"): _mean([_number(r.get(k)) for r in train]) for k in clip_keys},
        "train_s": sum(r["time/step"] for r in train),
        "times": (start, end),
        # an older record without times kept its wall time in wall_s
        "wall_s": end - start if start is not None and end is not None else _recorded_wall(folder),
        # the actor's peak memory, GiB (the fullest rank's since it started); absent in older runs' metrics
        "actor_peak_gib": max(
            (r["actor/peak_memory_gib"] for r in train if "actor/peak_memory_gib" in r), default=None
        ),
        "config": {k: _select(cfg, k) for k in (*BUDGET_KEYS, *BEFORE_KEYS)},
    }


def run_times(folder: Path) -> tuple[float | None, float | None]:
    """(start, end) of a run in seconds since the epoch; None where unknown.

    compare.sh's RECORD keeps them in ``times`` ("<start> <end>"), because a restored copy's file times
    are the copy's; records made before it kept only the wall time (``wall_s``) and give (None, None).
    Otherwise: config.yaml is written when the run starts, metrics.jsonl at each step and evaluation.
    """
    if (folder / "times").is_file():
        start, end = (float(t) for t in (folder / "times").read_text().split())
        return start, end
    if (folder / "wall_s").is_file():
        return None, None
    start = folder / "config.yaml"
    return (start.stat().st_mtime if start.is_file() else None), (folder / "metrics.jsonl").stat().st_mtime


def _recorded_wall(folder: Path) -> float | None:
    return float((folder / "wall_s").read_text()) if (folder / "wall_s").is_file() else None


def _eval_means(row: dict | None) -> dict[str, float]:
    """``{"<dataset> mean@<n>": value, "<dataset> maj@<n>": ..., "<dataset> pass@<n>": ...}`` of an evaluation
    row (empty for None); of the pass@k only k = n, the one that counts every sample."""
    if row is None:
        return {}
    found = {k: m for k in row if (m := EVAL_MEAN.match(k))}
    full = {(m["dataset"], m["n"]) for m in found.values() if m["metric"] == "mean"}
    return {
        f"{m['dataset']} {m['metric']}@{m['n']}": row[k]
        for k, m in found.items()
        if m["metric"] != "pass" or (m["dataset"], m["n"]) in full
    }


# The step-0 evaluation depends only on these settings and the seed (compare.sh SHARED_BEFORE=1
# lets one run per seed make it).
BEFORE_KEYS = ("model.path", "eval.datasets", "eval.n", "eval.max_tokens")


def share_before(summaries: list[dict], others: list[dict] = ()) -> None:
    """Give each run without a step-0 evaluation the one of a run with the same seed and BEFORE_KEYS,
    among ``summaries`` or ``others`` (runs not reported, e.g. stopped ones that did evaluate).

    Sets ``before`` and ``before_from`` (the folder it came from) in place; runs with none to
    borrow keep an empty ``before``.
    """

    def key(s):
        return s["seed"], *(repr(s["config"][k]) for k in BEFORE_KEYS)

    donors = {key(s): s for s in [*others, *summaries] if s["before"]}
    for s in summaries:
        if not s["before"] and key(s) in donors:
            s["before"], s["before_from"] = donors[key(s)]["before"], donors[key(s)]["folder"]


def _load_config(folder: Path):
    from omegaconf import OmegaConf

    path = folder / "config.yaml"
    return OmegaConf.load(path) if path.is_file() else None


def _select(cfg, key: str):
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key) if cfg is not None else None
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def budget_check(summaries: list[dict]) -> tuple[dict, dict]:
    """(keys every run shares with their value, keys that differ with their values by run folder)."""
    same, differ = {}, {}
    for key in BUDGET_KEYS:
        values = {str(s["folder"]): s["config"][key] for s in summaries}
        if len({repr(v) for v in values.values()}) == 1:
            same[key] = next(iter(values.values()))
        else:
            differ[key] = values
    return same, differ
