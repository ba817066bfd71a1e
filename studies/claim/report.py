"""The claim study's report from its records alone (``protocol.md``, "Report"): ``results.md`` beside this
file leads with both tests' verdicts (or "interim: k of 5 seeds" while seeds are missing), then Test 1's
rules with their numbers, a table of every run, the machines, the records' paths, and the figure
``results-random.png`` beside it (probe entropy over steps, one colour an arm, one thin line a seed; the
rollout entropy beside it); then Test 2's section (``learn_report``) and its figure ``results-learn.png``.

    python -m studies.claim.report [--records DIR] [--out FILE]

It works with whatever runs are recorded (none included: it says so). The rules and their levels are
``stats``'s; the runs are read by ``records``. Both files are written atomically.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bandpo.checkpoint.atomic import write_text_atomic
from bandpo.viz import save_figure
from studies.claim import learn_report, stats
from studies.claim.design import LEARN, RANDOM
from studies.claim.records import PROBE, Run, read_test

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "records"
OUT = HERE / "results.md"
FIGURE = "results-random.png"  # beside results.md
LABELS = {
    "grpo": "GRPO",
    "no_clip": "no-clip",
    "bandpo": "Band-KL",
    "clip_higher": "Clip-Higher",
    "clip_cov": "Clip-Cov",
    "kl_cov": "KL-Cov",
}
COLORS = {
    "grpo": "tab:red",
    "no_clip": "tab:gray",
    "bandpo": "tab:blue",
    "clip_higher": "tab:orange",
    "clip_cov": "tab:green",
    "kl_cov": "tab:purple",
}
# Rule 3: the secondary comparisons (arm, reference).
SECONDARY = (("clip_higher", "grpo"), ("clip_cov", "grpo"), ("kl_cov", "grpo"), ("bandpo", "no_clip"))
HEADLINES = {
    stats.RAISES: "Band raises entropy relative to GRPO",
    stats.LOWERS: "Band lowers entropy relative to GRPO",
    stats.NO_DIFFERENCE: "no difference of 0.10 or more between Band and GRPO",
    stats.INCONCLUSIVE: "Band against GRPO is inconclusive",
}


ORDER = (*RANDOM.arms, *RANDOM.secondary)  # the design's order: primary arms, then secondary


def ordered(runs: Sequence[Run]) -> list[Run]:
    """Runs in the design's arm order, then by seed; an arm the design lacks comes last."""
    return sorted(runs, key=lambda r: (ORDER.index(r.arm) if r.arm in ORDER else len(ORDER), r.arm, r.seed))


def label(arm: str) -> str:
    return LABELS.get(arm, arm)


def endpoints(runs: Sequence[Run], steps: int = RANDOM.steps) -> list[stats.Endpoint]:
    """Each run's D (protocol: D = ln(H_probe(20) / H_probe(0))) with its machine kind and precision."""
    return [
        stats.Endpoint(r.arm, r.seed, stats.log_change(r.probe[0], r.probe[steps]), r.machine, r.precision)
        for r in runs
    ]


def _f(x: float | None, fmt: str = "+.4f") -> str:
    return "-" if x is None else format(x, fmt)


def _ci(iv: stats.Interval | None) -> str:
    if iv is None or iv.lo is None:
        return "no interval (fewer than 2 pairs)"
    return f"{100 * iv.level:g}% [{_f(iv.lo)}, {_f(iv.hi)}]"


def _look(c: stats.Comparison) -> str:
    kind, n = c.look
    if kind == "interim":
        return f"interim: {len(c.d)} of {n} seeds, no class"
    return f"{kind} look, {n} seeds"


def comparison_lines(c: stats.Comparison) -> list[str]:
    """One comparison: d per seed, mean and sd, both intervals, the class (or why none), the splits."""
    name = f"d = D_{c.arm} - D_{c.ref}"
    if not c.d:
        out = [f"- {name}: no complete pair yet."]
    else:
        per_seed = ", ".join(f"s{s} {c.d[s]:+.4f}" for s in sorted(c.d))
        iv = c.decision
        out = [
            f"- {name} per seed: {per_seed}.",
            f"- mean {_f(iv.mean)}, sd {_f(iv.sd, '.4f')} (n {iv.n}); decision {_ci(iv)}; shown {_ci(c.shown)}.",
            f"- {_look(c)}" + (f": **{c.verdict}**." if c.verdict else "."),
        ]
    for sp in c.splits:
        out.append(f"- seed {sp.seed} left out, a split pair ({sp.reason}): to be run again.")
    return out


def headline(rule1: stats.Comparison, rule2: stats.Comparison, extend: bool | None, n_runs: int) -> str:
    if n_runs == 0:
        return "**Test 1: no runs are recorded yet.**"
    if rule2.interim:
        target = rule2.look[1]
        return (
            f"**Test 1: interim: {len(rule2.d)} of {target} seeds** (Band-KL and GRPO paired; the numbers "
            "below are shown, no verdict yet)."
        )
    text = f"**Test 1 ({rule2.look[0]} look, {rule2.look[1]} seeds, 97.5% intervals): {HEADLINES[rule2.verdict]}.**"
    visible = stats.sensitivity(rule1)
    if visible is False:
        text += (
            " Descriptive only: GRPO's D did not differ from the no-clip control's, so the clip's own effect"
            " was not visible at this scale (rule 1)."
        )
    elif visible is None:
        text += " Rule 1 (GRPO against no-clip) is still interim."
    if extend:
        text += (
            f" The 8-seed rule calls for seeds {', '.join(map(str, stats.EXTENSION_SEEDS))} of "
            f"{', '.join(stats.EXTENSION_ARMS)}."
        )
    return text


def rule1_lines(c: stats.Comparison) -> list[str]:
    visible = stats.sensitivity(c)
    if visible is None:
        said = "Interim: no sensitivity call yet."
    elif visible:
        said = "The interval excludes 0: a clip's own effect is visible at this scale; rules 2 and 3 decide."
    else:
        said = (
            "The interval includes 0: the clip's own effect was not visible at this scale, and every "
            "comparison below is descriptive."
        )
    return [*comparison_lines(c), f"- {said}"]


def extension_lines(c: stats.Comparison) -> list[str]:
    extend = stats.extension(c)
    if extend is None:
        return ["- Not yet applicable: seeds 0-4 of Band-KL and GRPO are not all paired."]
    first = [c.d[s] for s in range(stats.FIRST_LOOK)]
    iv = stats.interval(first, stats.DECISION_LEVEL)
    said = (
        f"run seeds {', '.join(map(str, stats.EXTENSION_SEEDS))} of {', '.join(stats.EXTENSION_ARMS)}, "
        "then apply the rules once more at 8 seeds (97.5%; no further extension)."
        if extend
        else "no extension."
    )
    return [
        f"- At 5 seeds: rule 2 {stats.classify(iv)}, sample sd of d {iv.sd:.4f} "
        f"(threshold {stats.SIGMA_MAX:.3f}): {said}"
    ]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def run_table(runs: Sequence[Run], steps: int) -> list[str]:
    key = runs[0].eval_key if runs else "eval mean@n"
    lines = [
        f"| arm | seed | H0 | H{steps} | D | rollout H step 1 | step {steps} | {key} step 0 (%) | step {steps} (%) "
        "| machine | precision | wall (min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        d = stats.log_change(r.probe[0], r.probe[steps])
        wall = "-" if r.wall_s is None else f"{r.wall_s / 60:.1f}"
        lines.append(
            f"| {label(r.arm)} | {r.seed} | {r.probe[0]:.4f} | {r.probe[steps]:.4f} | {d:+.4f} | "
            f"{_f(r.rollout.get(1), '.4f')} | {_f(r.rollout.get(steps), '.4f')} | "
            f"{_pct(r.evals.get(0))} | {_pct(r.evals.get(steps))} | {r.machine_label} | {r.precision} | {wall} |"
        )
    return lines


def machine_lines(runs: Sequence[Run]) -> list[str]:
    kinds = Counter((r.machine_label, r.precision) for r in runs)
    return [f"- {m}, {p}: {n} run{'s' if n != 1 else ''}" for (m, p), n in sorted(kinds.items())]


def figure(runs: Sequence[Run], png: Path) -> Path:
    """Probe entropy by step (the endpoint's measure) and rollout entropy by step: one colour an arm, one
    thin line a seed. Saved beside the report through a temporary file and a rename."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_r) = plt.subplots(1, 2, figsize=(12, 4.6))
    seen = set()
    for r in runs:
        color = COLORS.get(r.arm)
        first = r.arm not in seen
        seen.add(r.arm)
        for ax, series in ((ax_p, r.probe), (ax_r, r.rollout)):
            if series:
                steps = sorted(series)
                ax.plot(
                    steps,
                    [series[s] for s in steps],
                    color=color,
                    lw=0.9,
                    alpha=0.8,
                    marker="o" if ax is ax_p else None,
                    ms=2.5,
                    label=label(r.arm) if first else None,
                )
    ax_p.set(xlabel="step", ylabel=f"{PROBE} (nats/token)", title="Fixed-text probe entropy (endpoint)")
    ax_r.set(xlabel="step", ylabel="actor/entropy (nats/token)", title="Rollout entropy")
    for ax in (ax_p, ax_r):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Test 1: random rewards, one line a seed", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, png, dpi=110)


def report(
    runs: Sequence[Run],
    out: Path,
    steps: int = RANDOM.steps,
    figure_name: str | None = FIGURE,
    learn: Sequence[Run] = (),
    learn_figure: str | None = None,
    pilots: Sequence[Path] = (),
) -> str:
    """results.md's text for ``runs`` (any subset of Test 1's runs) and ``learn`` (Test 2's); each figure
    is linked when named."""
    runs = ordered(runs)
    ends = endpoints(runs, steps)
    rule1 = stats.compare("grpo", "no_clip", ends)
    rule2 = stats.compare("bandpo", "grpo", ends)
    extend = stats.extension(rule2)
    seeds = {a: sorted(r.seed for r in runs if r.arm == a) for a in dict.fromkeys(r.arm for r in runs)}
    lines = [
        "# The entropy claim: each clip's own effect under random rewards (Test 1), and GRPO against Band on a "
        "pool it cannot exhaust (Test 2)",
        "",
        headline(rule1, rule2, extend, len(runs)),
        "",
        learn_report.headline(learn_report.verdict(learn), len(learn)),
        "",
        "## Test 1: each clip's own effect on entropy under random rewards",
        "",
        "Rules fixed in advance: [protocol.md](protocol.md), Test 1 and its amendments. Endpoint per run "
        f"D = ln(H_probe({steps}) / H_probe(0)) on the fixed-text probe (`{PROBE}`); paired per seed "
        "d = D_arm - D_ref, only between runs of one machine kind (CPU name and hardware bf16) in one "
        "precision; Student-t intervals with seeds as units. Decisions use 97.5% intervals at both looks "
        '("the first look also uses 97.5%"), rule 1 included; the 95% interval the rules were first '
        "written at is shown beside. With fewer than 5 complete pairs a comparison is interim: numbers, "
        "no class.",
        "",
    ]
    test2 = learn_report.section(learn, out, learn_figure, pilots)
    if not runs:
        lines += ["No runs are recorded yet (`records/random/<arm>-s<seed>/`, written by `run.py`).", ""]
        return "\n".join([*lines, *test2])
    if figure_name:
        lines += [f"![probe and rollout entropy over steps]({figure_name})", ""]
    lines += ["### Rule 1: sensitivity (GRPO against the no-clip control)", "", *rule1_lines(rule1), ""]
    lines += ["### Rule 2: Band-KL against GRPO", "", *comparison_lines(rule2), ""]
    lines += ["### The 8-seed rule", "", *extension_lines(rule2), ""]
    lines += ["### Rule 3: secondary comparisons", ""]
    for arm, ref in SECONDARY:
        lines += [
            f"#### {label(arm)} against {label(ref)}",
            "",
            *comparison_lines(stats.compare(arm, ref, ends)),
            "",
        ]
    lines += [
        "### Runs",
        "",
        "Seeds recorded per arm: " + "; ".join(f"{label(a)} {s}" for a, s in seeds.items()),
        "",
        "H: the fixed-text probe (the endpoint). Rollout H (`actor/entropy`) is the policy's entropy on its "
        "own samples, shown and never tested: where it falls far below the probe's, the policy's own "
        "text has collapsed although the probe's texts are still read with the base model's spread.",
        "",
    ]
    lines += [*run_table(runs, steps), "", "### Machines", "", *machine_lines(runs), ""]
    lines += ["### Records", ""]
    lines += [f"- `{os.path.relpath(r.folder, out.parent)}/`" for r in runs]
    return "\n".join([*lines, "", *test2])


def main(argv: Sequence[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", default=str(RECORDS), help="the records folder (holding random/, learn/)")
    ap.add_argument("--out", default=str(OUT), help="the report; the figure is written beside it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = read_test(Path(args.records) / RANDOM.name, RANDOM.steps)
    learn = read_test(Path(args.records) / LEARN.name, LEARN.steps)
    written = [out]
    if runs:
        written.append(figure(runs, out.parent / FIGURE))
    if learn:
        written.append(learn_report.figure(learn, out.parent / learn_report.FIGURE))
    pilots = sorted(p.parent for p in (Path(args.records) / "learn-pilots").glob("*/*/run.json"))
    text = report(
        runs,
        out,
        RANDOM.steps,
        FIGURE if runs else None,
        learn,
        learn_report.FIGURE if learn else None,
        pilots,
    )
    write_text_atomic(out, text)
    print("wrote " + ", ".join(map(str, written)))
    return out


if __name__ == "__main__":
    main()
