"""Test 2's part of the report (``protocol.md``, "Test 2" and "Report"), from its records alone: the pilot's
gate on GRPO seed 0, the verdict (or "interim" while seeds are missing) with each endpoint per seed and its
intervals, the 8-seed rule, a table of every run, and the figure ``results-learn.png`` (rollout entropy
over steps, both arms, every seed, the fixed-text probe beside it). ``report`` composes it with Test 1's
into ``results.md``; the rules and their levels are ``learn_stats``'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from bandpo.viz import save_figure
from studies.claim import learn_stats as ls
from studies.claim.design import LEARN
from studies.claim.records import ACCURACY, FIRST_N, PROBE, ROLLOUT, ZERO_SIGNAL, Run
from studies.claim.stats import EXTENSION_SEEDS

FIGURE = "results-learn.png"  # beside results.md
LABELS = {"grpo": "GRPO", "bandpo": "Band-KL"}
COLORS = {"grpo": "tab:red", "bandpo": "tab:blue"}
WHAT = {
    "r": "r = ln(rollout entropy, steps 31-40, Band-KL / GRPO) (primary)",
    "f": "f = ln(probe entropy at step 40, Band-KL / GRPO) (co-primary)",
    "length": f"the length check: r on `{FIRST_N}`",
    "a": "a = held-out mean@8 at step 40, Band-KL - GRPO, points (non-inferior above -5)",
}


def ends(r: Run) -> ls.Ends:
    """A run's endpoint numbers (a missing step is an error naming the run)."""
    try:
        return ls.Ends(
            r.arm,
            r.seed,
            ls.window_mean(r.rollout, ls.LAST, ROLLOUT),
            ls.window_mean(r.first_n, ls.LAST, FIRST_N),
            r.probe[LEARN.steps],
            r.evals[LEARN.steps],
            r.machine,
            r.precision,
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"{r.folder}: {e}") from None


def _ci(iv) -> str:
    if iv is None or iv.lo is None:
        return "no interval (fewer than 2 pairs)"
    return f"{100 * iv.level:g}% [{iv.lo:+.4f}, {iv.hi:+.4f}]"


def gate_lines(runs: Sequence[Run]) -> list[str]:
    """The pilot's gate on GRPO seed 0 (protocol, Test 2, "Pilot")."""
    pilot = next((r for r in runs if r.arm == "grpo" and r.seed == 0), None)
    if pilot is None:
        return ["- The pilot (GRPO, seed 0) is not recorded yet."]
    checks = ls.pilot_gate(pilot.accuracy, pilot.zero_signal, pilot.rollout)
    out = [
        f"- {c.name}: {c.value:.3f} (must be {c.bound}): {'passes' if c.passed else 'FAILS'}." for c in checks
    ]
    passed = all(c.passed for c in checks)
    out.append(
        "- The pilot passes: it is seed 0's GRPO arm."
        if passed
        else "- The pilot fails the gate: it is reported and never used; the protocol's amendments name the next pool."
    )
    out.append(
        f"- Read from `{ACCURACY}`, `{ZERO_SIGNAL}` (rewards all alike, overlong penalty included), `{ROLLOUT}`."
    )
    return out


def headline(v: ls.Verdict, n_runs: int) -> str:
    if n_runs == 0:
        return "**Test 2: no runs are recorded yet.**"
    if v.interim:
        return (
            f"**Test 2: interim: {len(v.pairs)} of {v.look[1]} seeds** (Band-KL and GRPO paired; the numbers "
            "below are shown, no verdict yet)."
        )
    return f"**Test 2 ({v.look[0]} look, {v.look[1]} seeds, 97.5% intervals): the claim {v.verdict}.**"


def verdict_lines(v: ls.Verdict) -> list[str]:
    if not v.pairs:
        out = ["- No complete pair yet."]
    else:
        out = []
        for key, what in WHAT.items():
            per_seed = ", ".join(f"s{p.seed} {getattr(p, key):+.4f}" for p in v.pairs)
            iv = getattr(v, key)
            out.append(
                f"- {what}: {per_seed}; mean {iv.mean:+.4f}, decision {_ci(iv)}, shown {_ci(v.shown[key])}."
            )
        state = (
            f"interim: {len(v.pairs)} of {v.look[1]} seeds, no verdict" if v.interim else f"**{v.verdict}**"
        )
        out.append(f"- {state}.")
    out += [f"- seed {seed} left out, a split pair ({why}): to be run again." for seed, why in v.splits]
    extend = ls.extension(v)
    if extend is None:
        out.append("- The 8-seed rule: not yet applicable (seeds 0-4 not all paired).")
    else:
        out.append(
            "- The 8-seed rule: "
            + (
                f"run seeds {', '.join(map(str, EXTENSION_SEEDS))} of both arms, decide at 8."
                if extend
                else "no extension."
            )
        )
    return out


def run_table(runs: Sequence[Run]) -> list[str]:
    steps = LEARN.steps
    lines = [
        "| arm | seed | acc steps 1-3 (%) | rollout H steps 1-5 | 31-40 | first-n H 31-40 | probe H0 | "
        f"H{steps} | held-out step 0 (%) | step {steps} (%) | machine | precision | wall (min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def mean(series, window, scale=1.0, fmt=".4f"):
        """The window's mean as a table cell; "-" where a step of it is missing."""
        try:
            return format(scale * ls.window_mean(series, window, ""), fmt)
        except ValueError:
            return "-"

    for r in runs:
        acc = mean(r.accuracy, ls.EARLY, 100.0, ".1f")
        ev = [("-" if r.evals.get(s) is None else f"{100 * r.evals[s]:.1f}") for s in (0, steps)]
        wall = "-" if r.wall_s is None else f"{r.wall_s / 60:.1f}"
        lines.append(
            f"| {LABELS.get(r.arm, r.arm)} | {r.seed} | {acc} | {mean(r.rollout, ls.FIRST)} | "
            f"{mean(r.rollout, ls.LAST)} | {mean(r.first_n, ls.LAST)} | {r.probe[0]:.4f} | {r.probe[steps]:.4f} | "
            f"{ev[0]} | {ev[1]} | {r.machine_label} | {r.precision} | {wall} |"
        )
    return lines


def figure(runs: Sequence[Run], png: Path) -> Path:
    """Rollout entropy by step (the primary's measure) and the fixed-text probe by step: one colour an arm,
    one thin line a seed; written through a temporary file and a rename."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_p) = plt.subplots(1, 2, figsize=(12, 4.6))
    seen = set()
    for r in runs:
        first = r.arm not in seen
        seen.add(r.arm)
        for ax, series in ((ax_r, r.rollout), (ax_p, r.probe)):
            steps = sorted(series)
            ax.plot(
                steps,
                [series[s] for s in steps],
                color=COLORS.get(r.arm),
                lw=0.9,
                marker=None if ax is ax_r else "o",
                ms=2.5,
                label=LABELS.get(r.arm, r.arm) if first else None,
            )
    ax_r.axvspan(ls.LAST.start - 0.5, ls.LAST.stop - 0.5, color="0.9", zorder=0)
    ax_r.set(xlabel="step", ylabel=f"{ROLLOUT} (nats/token)", title="Rollout entropy (primary: steps 31-40)")
    ax_p.set(xlabel="step", ylabel=f"{PROBE} (nats/token)", title="Fixed-text probe entropy (co-primary)")
    for ax in (ax_r, ax_p):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "Test 2: GRPO against Band-KL on level-1 and level-2 one-operation problems, one line a seed",
        fontsize=10,
    )
    fig.tight_layout()
    return save_figure(fig, png, dpi=110)


def verdict(runs: Sequence[Run]) -> ls.Verdict:
    """The verdict over the runs that reach the endpoints (a run of another arm is left out)."""
    return ls.compare([ends(r) for r in runs if r.arm in LABELS])


def pilot_lines(pilots: Sequence[Path], out: Path) -> list[str]:
    """Failed pilots (``records/learn-pilots/<pool>/grpo-s0/``): where they are and why they stopped; never
    used (protocol, Test 2: "failed pilots are reported, never used")."""
    lines = []
    for folder in pilots:
        info = json.loads((folder / "run.json").read_text())
        why = info.get("stopped_because", "ran to its end")
        lines.append(f"- `{os.path.relpath(folder, out.parent)}/` (pool {info.get('pool', '?')}): {why}.")
    return lines


def section(
    runs: Sequence[Run], out: Path, figure_name: str | None, pilots: Sequence[Path] = ()
) -> list[str]:
    """Test 2's section of results.md (after both headlines); ``pilots`` are failed pilots' folders."""
    runs = sorted(runs, key=lambda r: (r.seed, r.arm != "grpo", r.arm))
    lines = [
        "## Test 2: GRPO against Band-KL on a pool GRPO cannot exhaust",
        "",
        "Rules fixed in advance: [protocol.md](protocol.md), Test 2 and amendments 3-5. Per seed, paired "
        "only between runs of one machine kind in one precision; Student-t intervals with seeds as units, "
        "decisions at 97.5% at both looks, 95% shown beside. Holds when r and f lie above 0 and a above -5; "
        "fails when r lies below ln 1.25 or a below -5; inconclusive otherwise.",
        "",
    ]
    if pilots:
        lines += ["### Failed pilots (reported, never used)", "", *pilot_lines(pilots, out), ""]
    if not runs:
        return [*lines, "No runs are recorded yet (`records/learn/<arm>-s<seed>/`, written by `run.py`).", ""]
    if figure_name:
        lines += [f"![rollout and probe entropy over steps]({figure_name})", ""]
    lines += ["### The pilot's gate", "", *gate_lines(runs), ""]
    lines += ["### Verdict", "", *verdict_lines(verdict(runs)), ""]
    lines += ["### Runs", "", *run_table(runs), "", "### Records", ""]
    lines += [f"- `{os.path.relpath(r.folder, out.parent)}/`" for r in runs]
    return [*lines, ""]
