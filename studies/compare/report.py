"""Summarise the tiny-arith algorithm comparison (compare.sh) into a markdown report and a plot.

    .venv/bin/python -m studies.compare.report [--runs runs/compare] \\
        [--out recipes/tiny_arith/results.md] [--command TEXT ...] [--reading reading.md]

Reads every ``<runs>/<label>-s<seed>/metrics.jsonl`` (unfinished runs too, marked as such)
and writes ``--out`` with: the command and machine, the budget every run shares, held-out
mean@n (and maj@n, pass@n where logged) before and after training and the per-seed change
(mean +/- sample std over seeds), the entropy and response length by step, the clip fraction by
old-probability bin (averaged over each run's training steps; split into up- and down-clips where the
runs logged the split), one line per run, and
``<out stem>.png`` beside it, drawn by ``python -m bandpo.viz compare`` (the exact command is in the
report). The runs are read in ``studies.compare.runs``, the report's tables made in ``studies.compare.tables``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bandpo.viz import main as viz_main
from bandpo.viz import plot_headline
from studies.compare.runs import find_runs, run_summary, share_before
from studies.compare.tables import (
    _accuracy_section,
    _budget_section,
    _clip_section,
    _entropy_section,
    _header_section,
    _length_section,
    _runs_section,
)

TITLE = "tiny_arith: GRPO vs Clip-Higher vs BandPO"
# bandpo.viz keys; of the clip bins only the tail one, where the algorithms differ most (the table has all).
PLOT_KEYS = ("accuracy", "mean@", "entropy", "clip_frac_up", "clip_frac_down", "actor/clip_frac_bin/lt0.01")


def write_report(
    runs: dict[str, dict[int, Path]],
    out: Path,
    commands: list[str],
    runs_root: Path,
    reading: str | None = None,
    title: str = TITLE,
    headline: bool = False,
    before_runs: dict[str, dict[int, Path]] | None = None,
) -> Path:
    """Write the markdown report and its plot (``out`` with a .png suffix); returns ``out``.

    ``runs`` is ``find_runs(runs_root)``; ``commands`` are the lines that made the runs;
    ``reading`` (markdown) goes after the header as the section "Reading"; ``headline`` also
    draws ``<out stem>-headline.png`` (``bandpo.viz.plot_headline``) and shows it first; ``before_runs``
    (``find_runs`` of other folders) only lend their step-0 evaluations (``share_before``).
    """
    summaries = {
        label: [{"seed": seed, **run_summary(folder)} for seed, folder in seeds.items()]
        for label, seeds in runs.items()
    }
    others = [
        {"seed": seed, **run_summary(folder)}
        for seeds in (before_runs or {}).values()
        for seed, folder in seeds.items()
    ]
    share_before([s for group in summaries.values() for s in group], others)
    png = out.with_suffix(".png")
    viz_argv = [
        "compare",
        *[
            f"{label}={folder / 'metrics.jsonl'}"
            for label, seeds in runs.items()
            for folder in seeds.values()
        ],
        "--keys",
        *PLOT_KEYS,
        "--out",
        str(png),
    ]
    viz_main(viz_argv)
    commands = [
        *(commands or ["(runs made outside compare.sh)"]),
        f"python -m studies.compare.report --runs {runs_root} --out {out}",
    ]
    head_png = out.with_name(out.stem + "-headline.png")
    if headline:
        plot_headline(summaries, head_png)
    lines = [
        f"# {title}",
        "",
        *([f"![headline]({head_png.name})", ""] if headline else []),
        *_header_section(commands, summaries),
        *(["## Reading", "", reading.strip(), ""] if reading else []),
        *_budget_section(summaries),
        *_accuracy_section(summaries),
        *_entropy_section(summaries),
        *_length_section(summaries),
        *_clip_section(summaries),
        *_runs_section(summaries),
        "## Curves",
        "",
        f"![curves]({png.name})",
        "",
        "```",
        "python -m bandpo.viz " + " ".join(viz_argv),
        "```",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs", type=Path, default=Path("runs/compare"), help="folder holding <label>-s<seed>/ runs"
    )
    ap.add_argument("--out", type=Path, default=Path("recipes/tiny_arith/results.md"), help="markdown report")
    ap.add_argument(
        "--command", action="append", default=[], help="command line(s) that made the runs (repeatable)"
    )
    ap.add_argument(
        "--reading", type=Path, help="markdown file: your reading of the results, put after the header"
    )
    ap.add_argument("--title", default=TITLE, help="the report's title")
    ap.add_argument(
        "--before-runs",
        type=Path,
        action="append",
        default=[],
        help="folder of other <label>-s<seed>/ runs whose step-0 evaluations runs without one may share",
    )
    ap.add_argument(
        "--headline",
        action="store_true",
        help="also draw <out stem>-headline.png (entropy, clip by bin, held-out change) and show it first",
    )
    ns = ap.parse_args(argv)
    runs = find_runs(ns.runs)
    if not runs:
        ap.error(f"no runs under {ns.runs}: expected folders <label>-s<seed>/ holding metrics.jsonl")
    reading = ns.reading.read_text() if ns.reading else None
    before_runs = {
        f"{root}/{label}": seeds for root in ns.before_runs for label, seeds in find_runs(root).items()
    }
    out = write_report(runs, ns.out, ns.command, ns.runs, reading, ns.title, ns.headline, before_runs)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return out


if __name__ == "__main__":
    main()
