"""Every figure bandpo draws: the Band interval against fixed clipping, training curves from metrics
JSONL (a run's ``curves.png``, runs side by side), the evaluation's pass@k and accuracy-per-step plots
(``bandpo.eval.cli``), and the comparison report's headline figure (``studies/compare/report.py``).

    python -m bandpo.viz band --delta 0.05 --out band.png
    python -m bandpo.viz run runs/x/metrics.jsonl --out curves.png
    python -m bandpo.viz compare grpo=runs/g/metrics.jsonl bandpo=runs/b/metrics.jsonl --out cmp.png

Metrics files hold one JSON object per line with a "step" key (other lines are skipped).
A requested key selects every numeric metric whose name, or any "/"-separated part of
it, starts with the key: "clip_frac" selects "actor/clip_frac_up", "actor/clip_frac_down"
and "clip_frac_bin/lt0.01"; "entropy" selects "actor/entropy". Metrics logged only on
some steps (evaluation) are drawn at the steps where they appear.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

DEFAULT_KEYS = ("reward/mean", "accuracy", "mean@", "entropy", "clip_frac")  # mean@: held-out evals
# Fixed clipping intervals drawn against the band: GRPO/PPO 0.2/0.2 and Clip-Higher 0.2/0.28.
FIXED_CLIPS = ((0.8, 1.2), (0.8, 1.28))
_DIVERGENCE_STYLE = {"kl": ("KL", "tab:blue"), "tv": ("TV", "tab:orange"), "chi2": (r"$\chi^2$", "tab:green")}


# ------------------------------------------------------------------------------ band


def band_curves(
    delta: float, divergences: Sequence[str] = ("kl", "tv", "chi2"), p_min: float = 1e-4, points: int = 400
) -> dict[str, np.ndarray]:
    """Old probabilities ``p`` (log-spaced in [p_min, 1)) and the band (lower, upper) per divergence.

    Returns ``{"p": p, "<div>_lower": ..., "<div>_upper": ...}`` as float64 arrays.
    """
    import torch

    from bandpo.algo.band import band_bounds

    p = np.logspace(math.log10(p_min), math.log10(0.999), points)
    logp = torch.tensor(np.log(p), dtype=torch.float64)
    out = {"p": p}
    for div in divergences:
        lower, upper = band_bounds(logp, div, delta)
        out[f"{div}_lower"], out[f"{div}_upper"] = lower.numpy(), upper.numpy()
    return out


def plot_band(
    out_png: str | Path,
    delta: float = 0.05,
    divergences: Sequence[str] = ("kl", "tv", "chi2"),
    clips: Iterable[tuple[float, float]] = FIXED_CLIPS,
    p_min: float = 1e-4,
) -> Path:
    """Band bounds vs old probability (log x) for each divergence against fixed clipping.

    Left: the ratio interval [lower, upper]. Right: the same interval as the allowed change
    of the token's probability, p * (upper - 1) up and p * (1 - lower) down, where fixed
    clipping's eps * p shrinks with p and the band's does not. Returns the PNG path.
    """
    clips = tuple(clips)
    c = band_curves(delta, divergences, p_min)
    p = c["p"]
    fig, (ax_r, ax_d) = plt.subplots(1, 2, figsize=(13, 5.6))
    for div in divergences:
        label, color = _DIVERGENCE_STYLE.get(div, (div, None))
        lo, hi = c[f"{div}_lower"], c[f"{div}_upper"]
        ax_r.plot(p, hi, color=color, lw=2, label=f"{label} upper")
        ax_r.plot(p, lo, color=color, lw=2, ls="--", label=f"{label} lower")
        ax_d.plot(p, p * (hi - 1.0), color=color, lw=2, label=f"{label} up")
        ax_d.plot(p, p * (1.0 - lo), color=color, lw=2, ls="--", label=f"{label} down")
    greys = ("0.25", "0.55")
    for i, (lo, hi) in enumerate(clips):
        grey = greys[i % len(greys)]
        ax_r.axhline(hi, color=grey, lw=1.3, ls="-.", label=f"clip [{lo:g}, {hi:g}]")
        ax_r.axhline(lo, color=grey, lw=1.3, ls="-.")
    # Fixed clipping moves p by at most eps * p either way; one line per distinct eps.
    eps_dirs: dict[float, list[str]] = {}
    for lo, hi in clips:
        eps_dirs.setdefault(round(1.0 - lo, 12), []).append("down")
        eps_dirs.setdefault(round(hi - 1.0, 12), []).append("up")
    for i, (eps, dirs) in enumerate(sorted(eps_dirs.items())):
        ax_d.plot(
            p,
            eps * p,
            color=greys[i % len(greys)],
            lw=1.3,
            ls="-.",
            label=f"clip eps {eps:g} ({' & '.join(sorted(set(dirs), reverse=True))})",
        )
    ax_r.plot(p, 1.0 / p, color="0.75", lw=1, label="simplex limit 1/p")
    ax_r.set(
        xscale="log",
        ylim=(0, 3.2),
        xlabel=r"old probability $\pi_{old}(a|s)$",
        ylabel="ratio bound",
        title=rf"Ratio interval, $\delta$ = {delta:g}",
    )
    ax_d.set(
        xscale="log",
        yscale="log",
        ylim=(p_min * 1e-2, 1.0),
        xlabel=r"old probability $\pi_{old}(a|s)$",
        ylabel="allowed |change of probability|",
        title="Allowed probability change per update",
    )
    for ax in (ax_r, ax_d):
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    return save_figure(fig, out_png)


# --------------------------------------------------------------------------- metrics


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics JSONL file that are JSON objects with a "step" key, sorted by step."""
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a crash mid-write
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def select_series(rows: Sequence[dict], key: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{metric name: (steps, values)}`` for the numeric metrics that ``key`` selects."""
    names = sorted(
        {
            name
            for r in rows
            for name, v in r.items()
            if name != "step" and _matches(name, key) and _is_number(v)
        }
    )
    series = {}
    for name in names:
        pts = [(r["step"], float(r[name])) for r in rows if _is_number(r.get(name))]
        series[name] = (np.array([s for s, _ in pts], dtype=float), np.array([v for _, v in pts]))
    return series


def plot_run_metrics(
    metrics_jsonl_path: str | Path,
    out_png: str | Path,
    keys: Sequence[str] = DEFAULT_KEYS,
    title: str | None = None,
) -> Path:
    """One panel per key, one line per selected metric, against the step; returns the PNG path."""
    rows = read_metrics(metrics_jsonl_path)
    fig, axes = _panels(len(keys))
    for ax, key in zip(axes, keys):
        series = select_series(rows, key)
        for name, (steps, values) in series.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, lw=1.5, label=name)
        _finish_panel(ax, key, bool(series))
    fig.suptitle(title or str(metrics_jsonl_path), fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out_png)


def plot_compare(
    runs: Mapping[str, str | Path | Sequence[str | Path]],
    out_png: str | Path,
    keys: Sequence[str] = DEFAULT_KEYS,
    title: str | None = None,
) -> Path:
    """Runs side by side: one panel per key, one colour per run label.

    Args:
        runs: ``{label: metrics.jsonl}``, or ``{label: [metrics.jsonl, ...]}`` for seeds of one
            configuration, drawn as the mean over seeds with a +/- std band (at the steps
            every seed has).
        out_png: output file.
        keys: metric keys (see the module docstring); a key selecting several metrics
            draws each, distinguished by line style.
        title: figure title.

    Returns:
        The PNG path.
    """
    loaded = {
        label: [read_metrics(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        for label, paths in runs.items()
    }
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    fig, axes = _panels(len(keys))
    for ax, key in zip(axes, keys):
        drawn = False
        for i, (label, seeds) in enumerate(loaded.items()):
            per_seed = [select_series(rows, key) for rows in seeds]
            names = sorted(set().union(*per_seed))
            for j, name in enumerate(names):
                steps, mean, std = _seed_stats([s[name] for s in per_seed if name in s])
                if steps.size == 0:
                    continue
                line_label = label if len(names) == 1 else f"{label}: {name}"
                color = colors[i % len(colors)]
                ax.plot(
                    steps,
                    mean,
                    color=color,
                    ls=styles[j % len(styles)],
                    lw=1.6,
                    label=line_label,
                    marker="o" if len(steps) < 30 else None,
                    ms=3,
                )
                if len(seeds) > 1:
                    ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.15, lw=0)
                drawn = True
        _finish_panel(ax, key, drawn)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out_png)


def _seed_stats(series: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not series:
        return np.array([]), np.array([]), np.array([])
    common = sorted(set.intersection(*(set(s.tolist()) for s, _ in series)))
    steps = np.array(common, dtype=float)
    # The last value logged at a step wins if a step repeats (e.g. a resumed run).
    table = np.array([[dict(zip(s.tolist(), v.tolist()))[t] for t in common] for s, v in series])
    return steps, table.mean(axis=0), table.std(axis=0)


def _matches(name: str, key: str) -> bool:
    return name.startswith(key) or any(part.startswith(key) for part in name.split("/")[1:])


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _panels(n: int):
    cols = min(n, 2) if n <= 4 else 3
    rows = max(1, math.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _finish_panel(ax, key: str, drawn: bool) -> None:
    ax.set(title=key, xlabel="step")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(
            0.5,
            0.5,
            f"no metric matches {key!r}",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="0.5",
        )


def save_figure(fig, out_png: str | Path, dpi: int = 120) -> Path:
    """Saves ``fig`` to ``out_png`` through a temporary file and a rename (a reader sees the old figure or
    the whole new one; parent folders created), closes it, and returns the path."""
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}{out.suffix}")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------- evaluation


def plot_pass_at_k(results: Mapping[str, Mapping[str, Any]], path: str | Path, title: str = "pass@k") -> Path:
    """Save pass@k curves (one line per dataset, log2 k axis) as a PNG."""
    fig, ax = plt.subplots(figsize=(6, 4))
    all_ks: set[int] = set()
    for name, s in results.items():
        ks = sorted(int(k.split("@")[1]) for k in s if k.startswith("pass@"))
        all_ks.update(ks)
        ax.plot(ks, [100 * s[f"pass@{k}"] for k in ks], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(all_ks), [str(k) for k in sorted(all_ks)])
    ax.minorticks_off()
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("pass@k (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def plot_steps(rows: Sequence[tuple[int, Mapping[str, Mapping[str, Any]]]], path: Path, title: str) -> Path:
    """One panel per dataset: mean@n, maj@n and every pass@k (percent) against training step."""
    names = list(rows[0][1])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    steps = [s for s, _ in rows]
    for ax, name in zip(axes[0], names):
        summary = rows[0][1][name]
        n = summary["n"]
        keys = [f"mean@{n}", f"maj@{n}", *[k for k in summary if k.startswith("pass@")]]
        for key in keys:
            ys = [100 * r[name][key] if r[name].get(key) is not None else float("nan") for _, r in rows]
            ax.plot(steps, ys, marker="o", label=key, linewidth=2.2 if key.startswith("mean") else 1.2)
        ax.set_xlabel("training step")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


# -------------------------------------------- comparison report (studies/compare/report.py)


def plot_headline(summaries: dict[str, list[dict]], png: Path) -> Path:
    """Three panels for a README: rollout entropy over steps (mean over seeds, +/- sample std band), the
    share of each old-probability bin's tokens whose gradient the clip or mask removed, and the
    held-out change (after - before, points) of every mean@n / maj@n; one colour per label."""
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
    ax_e.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 1.25, 1.5 ticks
    ax_e.legend(fontsize=7)
    width = 0.8 / max(len(labels), 1)
    bins = [f"clip_frac_bin/{b}" for b in PROB_BIN_NAMES]
    datasets = report_datasets(summaries)
    bar_tops: dict[str, tuple] = {}
    for i, (label, group) in enumerate(summaries.items()):
        color = colors[i % len(colors)]
        values = [[100 * s["clip"][b] for s in group if s["clip"].get(b) is not None] for b in bins]
        x = np.arange(len(bins)) + (i - (len(labels) - 1) / 2) * width
        heights = [np.mean(v) if v else np.nan for v in values]
        bar_tops[label] = (x, heights)
        ax_c.bar(
            x,
            heights,
            width,
            color=color,
            label=label,
            yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in values],
            capsize=2,
        )
        deltas = [
            [100 * (s["after"][d] - s["before"][d]) for s in group if d in s["after"] and d in s["before"]]
            for d in datasets
        ]
        x = np.arange(len(datasets)) + (i - (len(labels) - 1) / 2) * width
        ax_a.bar(
            x,
            [np.mean(v) if v else np.nan for v in deltas],
            width,
            color=color,
            label=label,
            yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in deltas],
            capsize=2,
        )
    _cut_outlier_bars(ax_c, bar_tops)
    ax_c.set(
        title="gradient removed by the clip / mask, by old probability p (%)",
        xticks=range(len(bins)),
        xticklabels=[clip_label(b) for b in bins],
    )
    short = (
        [d.split(" ", 1)[1] for d in datasets] if len({d.split(" ")[0] for d in datasets}) == 1 else datasets
    )
    ax_a.set(title="held-out change after training (points)", xticks=range(len(datasets)), xticklabels=short)
    ax_a.axhline(0, color="0.3", lw=0.8)
    for ax in (ax_e, ax_c, ax_a):
        ax.grid(True, alpha=0.3)
    ax_c.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, png)


def _cut_outlier_bars(ax, bar_tops: dict[str, tuple]) -> None:
    """Keep the token-level clips readable beside a sequence-level one (GSPO clips whole responses, so
    15-22% of every bin here): when one label's tallest bar is over 3x every other label's, the axis stops
    at 1.5x the others' and that label's cut bars carry their values."""
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


def report_datasets(summaries: dict[str, list[dict]]) -> list[str]:
    """The "<dataset> <metric>@n" keys of the summaries' evaluations, by dataset, then mean, maj, pass."""
    names = {k for group in summaries.values() for s in group for k in (*s["before"], *s["after"])}
    # Per dataset: mean@n (accuracy), maj@n (the voted answer), pass@k (any sample right: how much the
    # policy still explores; RL that narrows the answers lowers it at large k).
    order = {"mean": 0, "maj": 1, "pass": 2}
    return sorted(names, key=lambda k: (k.split(" ")[0], order[k.split(" ")[1].split("@")[0]], k))


def clip_label(key: str) -> str:
    """Column title of a clip-fraction metric: its old-probability bin (and sign), or which total it is."""
    names = {
        "lt0.01": "p < 0.01",
        "0.01-0.1": "0.01 ≤ p < 0.1",
        "0.1-0.5": "0.1 ≤ p < 0.5",
        "ge0.5": "p ≥ 0.5",
        "clip_frac_up": "all, up (A > 0)",
        "clip_frac_down": "all, down (A < 0)",
        "clip_frac_dual": "all, dual clip",
    }
    kind, _, name = key.partition("/")
    sign = {"clip_frac_bin": "", "clip_frac_bin_up": ", up", "clip_frac_bin_down": ", down"}.get(kind)
    if sign is not None and name in names:
        return names[name] + sign
    return names.get(key, key)


# ------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m bandpo.viz", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    band = sub.add_parser("band", help="Band bounds vs old probability against fixed clipping")
    band.add_argument("--delta", type=float, default=0.05)
    band.add_argument("--divergences", nargs="+", default=["kl", "tv", "chi2"])
    band.add_argument("--out", default="band.png")
    run = sub.add_parser("run", help="training curves of one run")
    run.add_argument("metrics", help="metrics JSONL file")
    run.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    run.add_argument("--out", default="metrics.png")
    cmp_ = sub.add_parser("compare", help="several runs side by side")
    cmp_.add_argument("runs", nargs="+", help="LABEL=metrics.jsonl (repeat a label for seeds)")
    cmp_.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    cmp_.add_argument("--out", default="compare.png")
    ns = parser.parse_args(argv)
    if ns.cmd == "band":
        out = plot_band(ns.out, ns.delta, ns.divergences)
    elif ns.cmd == "run":
        out = plot_run_metrics(ns.metrics, ns.out, ns.keys)
    else:
        runs: dict[str, list[str]] = {}
        for spec in ns.runs:
            label, sep, path = spec.partition("=")
            if not sep:
                parser.error(f"expected LABEL=PATH, got {spec!r}")
            runs.setdefault(label, []).append(path)
        out = plot_compare(runs, ns.out, ns.keys)
    print(out)
    return out


if __name__ == "__main__":
    main()
