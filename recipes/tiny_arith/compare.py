"""Summarise the tiny-arith algorithm comparison (compare.sh) into a markdown report and a plot.

    .venv/bin/python recipes/tiny_arith/compare.py [--runs runs/compare] \\
        [--out recipes/tiny_arith/results.md] [--command TEXT ...] [--reading reading.md]

Reads every ``<runs>/<label>-s<seed>/metrics.jsonl`` (unfinished runs too, marked as such)
and writes ``--out`` with: the command and machine, the budget every run shares, held-out
mean@n (and maj@n, pass@n where logged) before and after training and the per-seed change
(mean +/- sample std over seeds), the final entropy, the clip fraction by old-probability bin
(averaged over each run's training steps), one line per run, and ``<out stem>.png`` beside it, drawn by
``python -m bandpo.viz compare`` (the exact command is in the report).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import time
from pathlib import Path

from bandpo.viz import clip_label, plot_headline, read_metrics, report_datasets
from bandpo.viz import main as viz_main

TITLE = "tiny_arith: GRPO vs Clip-Higher vs BandPO"
RUN_DIR = re.compile(r"^(?P<label>.+)-s(?P<seed>\d+)$")
EVAL_MEAN = re.compile(r"^eval/(?P<dataset>[^/]+)/(?P<metric>mean|maj|pass)@(?P<n>\d+)$")
# What must match for "equal budgets": only the algorithm and the seed may differ between runs.
BUDGET_KEYS = ("trainer.total_steps", "trainer.prompts_per_step", "rollout.n", "rollout.max_tokens",
               "rollout.temperature", "actor.lr", "actor.mini_batch_prompts", "actor.epochs", "model.path",
               "data.train", "eval.datasets", "eval.n", "eval.max_tokens")
# bandpo.viz keys; of the clip bins only the tail one, where the algorithms differ most (the table has all).
PLOT_KEYS = ("accuracy", "mean@", "entropy", "clip_frac_up", "clip_frac_down", "actor/clip_frac_bin/lt0.01")
# compare.sh runs these labels in this order; other labels found under --runs follow, sorted.
LABEL_ORDER = ("grpo", "clip_higher", "bandpo", "bandpo_d0.02", "bandpo_d0.1", "bandpo_filter", "bandpo_adaptive",
               "dppo_tv", "dppo_kl", "gspo", "cispo", "sapo", "bandpo_tv", "dcpo")


def find_runs(root: Path) -> dict[str, dict[int, Path]]:
    """``{label: {seed: run folder}}`` for the folders ``<label>-s<seed>`` under ``root`` with a metrics file."""
    runs: dict[str, dict[int, Path]] = {}
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        m = RUN_DIR.match(folder.name)
        if m and (folder / "metrics.jsonl").is_file():
            runs.setdefault(m["label"], {})[int(m["seed"])] = folder
    order = {label: i for i, label in enumerate(LABEL_ORDER)}
    return {label: dict(sorted(runs[label].items()))
            for label in sorted(runs, key=lambda s: (order.get(s, len(order)), s))}


def run_summary(folder: Path) -> dict:
    """One run's numbers: steps done and planned, eval before/after, final entropy, clip fractions.

    "before" is the step-0 evaluation; "after" is the last evaluation logged after step 0
    (the final one of a finished run). ``clip`` holds the clip fractions and the token share
    of each old-probability bin, each the mean over the training steps.
    """
    rows = read_metrics(folder / "metrics.jsonl")
    train = [r for r in rows if "time/step" in r]
    evals = [r for r in rows if any(EVAL_MEAN.match(k) for k in r)]
    before = next((r for r in evals if r["step"] == 0), None)
    after = next((r for r in reversed(evals) if r["step"] > 0), None)
    clip_keys = [k for k in (train[0] if train else {}) if k.startswith(("actor/clip_frac", "actor/token_frac_bin"))]
    cfg = _load_config(folder)
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
        "clip": {k.removeprefix("actor/"): _mean([_number(r.get(k)) for r in train]) for k in clip_keys},
        "train_s": sum(r["time/step"] for r in train),
        "wall_s": _wall_seconds(folder),
        "config": {k: _select(cfg, k) for k in (*BUDGET_KEYS, *BEFORE_KEYS)},
    }


def _wall_seconds(folder: Path) -> float | None:
    # config.yaml is written when the run starts, metrics.jsonl at each step and evaluation.
    start, end = folder / "config.yaml", folder / "metrics.jsonl"
    return end.stat().st_mtime - start.stat().st_mtime if start.is_file() else None


def _shared_before_note(summaries: dict[str, list[dict]]) -> list[str]:
    shared = [s for group in summaries.values() for s in group if s.get("before_from")]
    if not shared:
        return []
    sources = ", ".join(sorted({f"`{s['before_from']}`" for s in shared}))
    return [f"Runs that did not evaluate before step 1 ({len(shared)}): their *before* is the step-0 evaluation of "
            "the run with the same seed, model and eval settings that did (the same model, prompts and "
            f"sampling seed: the same numbers), from {sources}."]


def _eval_means(row: dict | None) -> dict[str, float]:
    """``{"<dataset> mean@<n>": value, "<dataset> maj@<n>": ..., "<dataset> pass@<n>": ...}`` of an evaluation
    row (empty for None); of the pass@k only k = n, the one that counts every sample."""
    if row is None:
        return {}
    found = {k: m for k in row if (m := EVAL_MEAN.match(k))}
    full = {(m["dataset"], m["n"]) for m in found.values() if m["metric"] == "mean"}
    return {f"{m['dataset']} {m['metric']}@{m['n']}": row[k] for k, m in found.items()
            if m["metric"] != "pass" or (m["dataset"], m["n"]) in full}


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


def mean_std(values: list[float | None], scale: float = 1.0, digits: int = 1) -> str:
    """``"mean ± std"`` over the values present (sample std; just the mean for one value; "n/a" for none)."""
    values = [scale * v for v in values if v is not None]
    if not values:
        return "n/a"
    text = f"{statistics.mean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


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


def write_report(runs: dict[str, dict[int, Path]], out: Path, commands: list[str], runs_root: Path,
                 reading: str | None = None, title: str = TITLE, headline: bool = False,
                 before_runs: dict[str, dict[int, Path]] | None = None) -> Path:
    """Write the markdown report and its plot (``out`` with a .png suffix); returns ``out``.

    ``runs`` is ``find_runs(runs_root)``; ``commands`` are the lines that made the runs;
    ``reading`` (markdown) goes after the header as the section "Reading"; ``headline`` also
    draws ``<out stem>-headline.png`` (``bandpo.viz.plot_headline``) and shows it first; ``before_runs``
    (``find_runs`` of other folders) only lend their step-0 evaluations (``share_before``).
    """
    summaries = {label: [{"seed": seed, **run_summary(folder)} for seed, folder in seeds.items()]
                 for label, seeds in runs.items()}
    others = [{"seed": seed, **run_summary(folder)} for seeds in (before_runs or {}).values()
              for seed, folder in seeds.items()]
    share_before([s for group in summaries.values() for s in group], others)
    png = out.with_suffix(".png")
    viz_argv = ["compare", *[f"{label}={folder / 'metrics.jsonl'}" for label, seeds in runs.items()
                             for folder in seeds.values()], "--keys", *PLOT_KEYS, "--out", str(png)]
    viz_main(viz_argv)
    commands = [*(commands or ["(runs made outside compare.sh)"]),
                f"python recipes/tiny_arith/compare.py --runs {runs_root} --out {out}"]
    head_png = out.with_name(out.stem + "-headline.png")
    if headline:
        plot_headline(summaries, head_png)
    lines = [f"# {title}", "", *([f"![headline]({head_png.name})", ""] if headline else []),
             *_header_section(commands, summaries),
             *(["## Reading", "", reading.strip(), ""] if reading else []),
             *_budget_section(summaries), *_accuracy_section(summaries), *_entropy_section(summaries),
             *_clip_section(summaries), *_runs_section(summaries),
             "## Curves", "", f"![curves]({png.name})", "", "```", "python -m bandpo.viz " + " ".join(viz_argv),
             "```", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


def _header_section(commands: list[str], summaries: dict[str, list[dict]]) -> list[str]:
    # A run's config.yaml is written when it starts, its metrics.jsonl at each step.
    folders = [s["folder"] for group in summaries.values() for s in group]
    starts = [(f / "config.yaml").stat().st_mtime for f in folders if (f / "config.yaml").exists()]
    first = min(starts) if starts else None
    last = max((f / "metrics.jsonl").stat().st_mtime for f in folders)
    u = platform.uname()
    return ["## Command and machine", "", "```", *commands, "```", "",
            f"- machine: `{u.system} {u.release} {u.machine}`, {_cpu_model()}, {os.cpu_count()} CPUs (nproc)",
            f"- runs: {_date(first) if first else '?'} to {_date(last)}",
            f"- summarised: {_date(time.time())} (load average {os.getloadavg()[0]:.1f})", ""]


def _budget_section(summaries: dict[str, list[dict]]) -> list[str]:
    same, differ = budget_check([s for group in summaries.values() for s in group])
    lines = ["## Budget", "", "Settings every run shares:", "", *[f"- `{k}` = `{v}`" for k, v in same.items()], ""]
    if not differ:
        return lines + ["Equal budgets: of the settings checked, only the algorithm and the seed differ.", ""]
    lines += ["**Warning: the runs do not share these settings (not an equal-budget comparison):**", ""]
    lines += [f"- `{k}`: " + ", ".join(f"{f}: `{v}`" for f, v in values.items()) for k, values in differ.items()]
    return lines + [""]


def _accuracy_section(summaries: dict[str, list[dict]]) -> list[str]:
    datasets = report_datasets(summaries)
    head = ["algorithm", "seeds", "steps"]
    for d in datasets:
        head += [f"{d} before", f"{d} after", f"{d} Δ"]
    lines = ["## Held-out accuracy and entropy", "",
             "Mean ± sample std over seeds; accuracies in %. Δ is after − before within each seed.",
             *_shared_before_note(summaries), "",
             *_table_head([*head, "final entropy"])]
    for label, group in summaries.items():
        cells = [label, ", ".join(str(s["seed"]) for s in group), _steps(group)]
        for d in datasets:
            pairs = [(s["before"].get(d), s["after"].get(d)) for s in group]
            cells += [mean_std([b for b, _ in pairs], 100), mean_std([a for _, a in pairs], 100),
                      mean_std([a - b if a is not None and b is not None else None for b, a in pairs], 100)]
        lines.append(_row([*cells, mean_std([s["entropy"] for s in group], digits=3)]))
    return lines + [""]


def _entropy_section(summaries: dict[str, list[dict]]) -> list[str]:
    """Mean token entropy of the rollouts at the first, middle and last step (the paper's collapse claim)."""
    last = max((s["steps"] for group in summaries.values() for s in group), default=0)
    steps = sorted({1, *(round(last * q / 4) for q in (1, 2, 3, 4))} - {0})
    if not steps:
        return []
    # The last five steps every run has: where runs stopped early, the ends compare at equal steps.
    common = min(s["steps"] for group in summaries.values() for s in group)
    window = range(max(1, common - 4), common + 1)
    lines = ["## Entropy over steps", "",
             "Mean token entropy of each step's rollout under pi_old (nats), mean ± sample std over seeds; "
             f"the last column averages each run's steps {window[0]}-{window[-1]}, the last five that every run has.",
             "", *_table_head(["algorithm", *[f"step {t}" for t in steps], f"steps {window[0]}-{window[-1]}"])]
    for label, group in summaries.items():
        ends = [_mean([s["entropy_by_step"].get(t) for t in window]) for s in group]
        lines.append(_row([label, *[mean_std([s["entropy_by_step"].get(t) for s in group], digits=3) for t in steps],
                           mean_std(ends, digits=3)]))
    return lines + [""]


def _clip_section(summaries: dict[str, list[dict]]) -> list[str]:
    keys = sorted({k for group in summaries.values() for s in group for k in s["clip"] if k.startswith("clip_frac")},
                  key=_clip_order)
    bins = [k for k in keys if k.startswith("clip_frac_bin/")]
    lines = ["## Clip fraction by old-probability bin", "",
             ("Per bin of old probability p: the fraction of that bin's tokens whose gradient the clip "
              "removed; the last columns are fractions of all tokens. Averaged over each run's training "
              "steps, then mean ± sample std over seeds (%)."), "",
             *_table_head(["algorithm", *[clip_label(k) for k in keys]])]
    for label, group in summaries.items():
        lines.append(_row([label, *[mean_std([s["clip"].get(k) for s in group], 100, 2) for k in keys]]))
    lines += ["", "Share of response tokens in each bin (%), for scale:", "",
              *_table_head(["algorithm", *[clip_label(b) for b in bins]])]
    for label, group in summaries.items():
        shares = [mean_std([s["clip"].get(b.replace("clip_frac_bin/", "token_frac_bin/")) for s in group], 100, 2)
                  for b in bins]
        lines.append(_row([label, *shares]))
    return lines + [""]


def _runs_section(summaries: dict[str, list[dict]]) -> list[str]:
    datasets = report_datasets(summaries)
    lines = ["## Runs", "", "Train time: the training steps' own time; wall: from the run's start to its last "
             "line (start-up and evaluations included).", "",
             *_table_head(["run", "steps", *[f"{d} before → after (%)" for d in datasets],
                           "final entropy", "train time (s)", "wall (s)"])]
    for s in (s for group in summaries.values() for s in group):
        evals = [f"{_pct(s['before'].get(d))} → {_pct(s['after'].get(d))}" for d in datasets]
        state = "" if s["finished"] else " (unfinished)"
        entropy = f"{s['entropy']:.3f}" if s["entropy"] is not None else "n/a"
        lines.append(_row([f"`{s['folder']}`", f"{s['steps']}/{s['total_steps']}{state}", *evals, entropy,
                           f"{s['train_s']:.0f}", f"{s['wall_s']:.0f}" if s["wall_s"] is not None else "n/a"]))
    return lines + [""]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _date(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(timestamp))


def _clip_order(key: str) -> tuple[int, str]:
    # Bins in probability order (as the loss defines them), then the totals: up, down, dual.
    from bandpo.algo.losses import PROB_BIN_NAMES

    name = key.removeprefix("clip_frac_bin/")
    if name in PROB_BIN_NAMES:
        return PROB_BIN_NAMES.index(name), ""
    totals = ("clip_frac_up", "clip_frac_down", "clip_frac_dual")
    return len(PROB_BIN_NAMES) + (totals.index(key) if key in totals else len(totals)), key


def _steps(group: list[dict]) -> str:
    """Steps done / planned of a group of seeds, as a range where the seeds differ ("5-12/12")."""
    def span(values):
        known = sorted({v for v in values if v is not None})
        if not known:
            return "?"
        return str(known[0]) if len(known) == 1 else f"{known[0]}-{known[-1]}"

    return f"{span([s['steps'] for s in group])}/{span([s['total_steps'] for s in group])}"


def _pct(v: float | None) -> str:
    return f"{100 * v:.1f}" if v is not None else "n/a"


def _table_head(cells: list[str]) -> list[str]:
    return [_row(cells), _row(["---"] * len(cells))]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("runs/compare"), help="folder holding <label>-s<seed>/ runs")
    ap.add_argument("--out", type=Path, default=Path("recipes/tiny_arith/results.md"), help="markdown report")
    ap.add_argument("--command", action="append", default=[], help="command line(s) that made the runs (repeatable)")
    ap.add_argument("--reading", type=Path, help="markdown file: your reading of the results, put after the header")
    ap.add_argument("--title", default=TITLE, help="the report's title")
    ap.add_argument("--before-runs", type=Path, action="append", default=[],
                    help="folder of other <label>-s<seed>/ runs whose step-0 evaluations runs without one may share")
    ap.add_argument("--headline", action="store_true",
                    help="also draw <out stem>-headline.png (entropy, clip by bin, held-out change) and show it first")
    ns = ap.parse_args(argv)
    runs = find_runs(ns.runs)
    if not runs:
        ap.error(f"no runs under {ns.runs}: expected folders <label>-s<seed>/ holding metrics.jsonl")
    reading = ns.reading.read_text() if ns.reading else None
    before_runs = {f"{root}/{label}": seeds for root in ns.before_runs for label, seeds in find_runs(root).items()}
    out = write_report(runs, ns.out, ns.command, ns.runs, reading, ns.title, ns.headline, before_runs)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return out


if __name__ == "__main__":
    main()
