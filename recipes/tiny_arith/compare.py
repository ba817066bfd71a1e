"""Summarise the tiny-arith algorithm comparison (compare.sh) into a markdown report and a plot.

    .venv/bin/python recipes/tiny_arith/compare.py [--runs runs/compare] \\
        [--out recipes/tiny_arith/results.md] [--command TEXT ...] [--reading reading.md]

Reads every ``<runs>/<label>-s<seed>/metrics.jsonl`` (unfinished runs too, marked as such)
and writes ``--out`` with: the command and machine, the budget every run shares, held-out
mean@n (and maj@n, pass@n where logged) before and after training and the per-seed change
(mean +/- sample std over seeds), the final entropy, the clip fraction by old-probability bin
(averaged over each run's training steps), one line per run, and ``<out stem>.png`` beside it, drawn by
``python -m bandpo.viz compare`` (the exact command is in the report). The runs are read in
``compare_runs.py``, the report's tables made in ``compare_tables.py``, both beside this script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bandpo.viz import main as viz_main

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this script, however it is loaded
from compare_runs import find_runs, run_summary, share_before
from compare_tables import (
    _accuracy_section,
    _budget_section,
    _clip_label,
    _clip_section,
    _datasets,
    _entropy_section,
    _header_section,
    _runs_section,
)

TITLE = "tiny_arith: GRPO vs Clip-Higher vs BandPO"
# bandpo.viz keys; of the clip bins only the tail one, where the algorithms differ most (the table has all).
PLOT_KEYS = ("accuracy", "mean@", "entropy", "clip_frac_up", "clip_frac_down", "actor/clip_frac_bin/lt0.01")


def write_report(runs: dict[str, dict[int, Path]], out: Path, commands: list[str], runs_root: Path,
                 reading: str | None = None, title: str = TITLE, headline: bool = False,
                 before_runs: dict[str, dict[int, Path]] | None = None) -> Path:
    """Write the markdown report and its plot (``out`` with a .png suffix); returns ``out``.

    ``runs`` is ``find_runs(runs_root)``; ``commands`` are the lines that made the runs;
    ``reading`` (markdown) goes after the header as the section "Reading"; ``headline`` also
    draws ``<out stem>-headline.png`` (``plot_headline``) and shows it first; ``before_runs``
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


def plot_headline(summaries: dict[str, list[dict]], png: Path) -> Path:
    """Three panels for a README: rollout entropy over steps (mean over seeds, +/- sample std band), the
    share of each old-probability bin's tokens whose gradient the clip or mask removed, and the
    held-out change (after - before, points) of every mean@n / maj@n; one colour per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from bandpo.algo.losses import PROB_BIN_NAMES

    labels = list(summaries)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax_e, ax_c, ax_a) = plt.subplots(1, 3, figsize=(16, 4.2))
    for i, (label, group) in enumerate(summaries.items()):
        steps = sorted(set.intersection(*(set(s["entropy_by_step"]) for s in group)))
        table = np.array([[s["entropy_by_step"][t] for t in steps] for s in group], dtype=float)
        mean, std = table.mean(axis=0), table.std(axis=0, ddof=1) if len(group) > 1 else 0 * table[0]
        name = f"{label} ({len(group)} seed{'s' if len(group) > 1 else ''})"
        ax_e.plot(steps, mean, color=colors[i % len(colors)], lw=1.8, label=name)
        if len(group) > 1:
            ax_e.fill_between(steps, mean - std, mean + std, color=colors[i % len(colors)], alpha=0.15, lw=0)
    ax_e.set(title="rollout entropy (nats/token)", xlabel="step")
    ax_e.legend(fontsize=7)
    width = 0.8 / max(len(labels), 1)
    bins = [f"clip_frac_bin/{b}" for b in PROB_BIN_NAMES]
    datasets = _datasets(summaries)
    bar_tops: dict[str, tuple] = {}
    for i, (label, group) in enumerate(summaries.items()):
        color = colors[i % len(colors)]
        values = [[100 * s["clip"][b] for s in group if s["clip"].get(b) is not None] for b in bins]
        x = np.arange(len(bins)) + (i - (len(labels) - 1) / 2) * width
        heights = [np.mean(v) if v else np.nan for v in values]
        bar_tops[label] = (x, heights)
        ax_c.bar(x, heights, width, color=color, label=label,
                 yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in values], capsize=2)
        deltas = [[100 * (s["after"][d] - s["before"][d]) for s in group if d in s["after"] and d in s["before"]]
                  for d in datasets]
        x = np.arange(len(datasets)) + (i - (len(labels) - 1) / 2) * width
        ax_a.bar(x, [np.mean(v) if v else np.nan for v in deltas], width, color=color, label=label,
                 yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in deltas], capsize=2)
    _cut_outlier_bars(ax_c, bar_tops)
    ax_c.set(title="gradient removed by the clip / mask, by old probability p (%)",
             xticks=range(len(bins)), xticklabels=[_clip_label(b) for b in bins])
    short = [d.split(" ", 1)[1] for d in datasets] if len({d.split(" ")[0] for d in datasets}) == 1 else datasets
    ax_a.set(title="held-out change after training (points)", xticks=range(len(datasets)), xticklabels=short)
    ax_a.axhline(0, color="0.3", lw=0.8)
    for ax in (ax_e, ax_c, ax_a):
        ax.grid(True, alpha=0.3)
    ax_c.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _cut_outlier_bars(ax, bar_tops: dict[str, tuple]) -> None:
    """Keep the token-level clips readable beside a sequence-level one (GSPO clips whole responses, so
    15-22% of every bin here): when one label's tallest bar is over 3x every other label's, the axis stops
    at 1.5x the others' and that label's cut bars carry their values."""
    import numpy as np

    tallest = {label: np.nanmax(h) if not np.all(np.isnan(h)) else 0.0 for label, (_, h) in bar_tops.items()}
    if len(tallest) < 2:
        return
    top = max(tallest, key=tallest.get)
    rest = max(v for label, v in tallest.items() if label != top)
    if rest <= 0 or tallest[top] <= 3 * rest:
        return
    ax.set_ylim(0, 1.5 * rest)
    for x, h in zip(*bar_tops[top]):
        if h > 1.5 * rest:
            ax.text(x, 1.45 * rest, f"{top}\n{h:.0f}%", ha="center", va="top", fontsize=6)


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
