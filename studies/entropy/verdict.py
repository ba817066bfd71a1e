"""Stage 2's verdict and report, from the records alone: the rules fixed before the runs (stated in
``RULES`` and as constants), the ratio and accuracy intervals, and the section's tables (the probe
entropy, the probe's responses, the held-out evaluations, the training signal).

    python -m studies.entropy.stage2 --report     # writes the section (and the headline figure)

Pure where it can be: the verdict takes numbers and returns words; the tables take what ``collect``
read from ``<records>`` (stage2.py's docstring lists the files). The runs' design (arms,
seeds, steps, the endpoint set) is design.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from studies.entropy import stats as entropy_stats
from studies.entropy.design import ARMS, ENDPOINT_SET, HEADING, PROBED, SEEDS, STEPS, plan, run_name

# The rules (the report's Stage 2 section states them in words, before the runs)
COLLAPSE = 0.5  # GRPO's probe entropy at step 60 over step 0's, at most: "fell by >= 50%"
HOLDS_RATIO = 2.0  # BandPO / GRPO at step 60 on every seed
FAILS_BELOW = 1.5  # the ratio interval's upper end under this: Band did not keep what the claim says
MARGIN = 10.0  # points of mean@8: the non-inferiority margin 3 seeds resolve (the report says why)


# --- the verdict (pure: numbers in, words out) ---


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` and its 95% interval: mean ln R -/+ t(0.95, n - 1) sd / sqrt(n),
    exponentiated."""
    iv = entropy_stats.mean_interval([math.log(r) for r in ratios])
    if iv.lo is None:
        raise ValueError("ratio_interval: at least 2 seeds")
    return math.exp(iv.mean), math.exp(iv.lo), math.exp(iv.hi)


def noninferiority(band: list[float], grpo: list[float], margin: float = MARGIN) -> tuple[float, float, bool]:
    """Paired by seed, points: the mean of band - grpo, the lower end of its one-sided 95% interval
    (t at the two-sided 90% level), and whether that end is above -``margin``."""
    iv = entropy_stats.mean_interval([b - g for b, g in zip(band, grpo, strict=True)], level=0.90)
    if iv.lo is None:
        raise ValueError("noninferiority: at least 2 seeds")
    return iv.mean, iv.lo, iv.lo > -margin


def verdict(h0: list[float], grpo60: list[float], band60: list[float]) -> str:
    """holds / fails / inconclusive by the rules (module constants), per seed s: G_s = grpo60 / h0,
    R_s = band60 / grpo60."""
    g = [b / a for a, b in zip(h0, grpo60, strict=True)]
    r = [b / a for a, b in zip(grpo60, band60, strict=True)]
    collapsed = all(x <= COLLAPSE for x in g)
    if collapsed and all(x >= HOLDS_RATIO for x in r):
        return "holds"
    if collapsed and ratio_interval(r)[2] < FAILS_BELOW:
        return "fails"
    return "inconclusive"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def run_names(records: Path) -> list[str]:
    """The runs the tables show: the plan's, then any other run with a record (a probe, an evaluation or
    a log), a replicate say (``bandpo-s0-replicate``). The verdict reads the plan's runs alone."""
    planned = [run_name(a, s) for a, s in plan()]
    found = {p.name.split("-", 1)[1].rsplit("-step_", 1)[0] for p in records.glob("*-step_*.json")}
    found |= {p.name[len("run-") :] for p in records.glob("run-*") if p.is_dir()}
    return planned + sorted(found - {"base", *planned})


def collect(records: Path) -> dict:
    """What the records hold: ``h0`` (the base model's probe entropy), ``h`` (probe entropies by run and
    step), ``probes`` (the probes' results by run and step: ``base`` at step 0, then ``run_names``),
    ``evals`` (below)."""
    base = _load(records / "probe-base-step_000000.json")
    probes = {"base": {0: base["probe"]}} if base else {}
    for name in run_names(records):
        probes[name] = {s: r["probe"] for s in PROBED
                        if (r := _load(records / f"probe-{name}-step_{s:06d}.json"))}  # fmt: skip
    h = {
        name: {s: p["entropy"] for s, p in by_step.items()}
        for name, by_step in probes.items()
        if name != "base"
    }
    evals = {}  # (run, step) -> the sampled evaluation's results, each set's with "greedy" (mean@1) added
    for path in records.glob("eval-*-sampled.json"):
        name, step = path.name[5:].rsplit("-step_", 1)
        results = json.loads(path.read_text())["results"]
        greedy = _load(path.with_name(path.name.replace("-sampled.json", "-greedy.json")))
        for name_set, m in (greedy or {}).get("results", {}).items():
            results.setdefault(name_set, {})["greedy"] = m["mean@1"]
        evals[(name, int(step.split("-")[0]))] = results
    return {
        "h0": None if base is None else base["probe"]["entropy"],
        "h": h,
        "probes": probes,
        "evals": evals,
    }


def metrics_rows(records: Path, name: str) -> list[dict]:
    """The per-step lines of run ``name``'s recorded metrics.jsonl, by step ([] without a record)."""
    from bandpo.viz import read_metrics

    path = records / f"run-{name}" / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


SIGNAL = (  # (column, metrics key, scale): what the policy gradient had to work with
    ("train accuracy", "reward/accuracy", 1),
    ("groups without advantage", "adv/zero_signal_group_frac", 1),
    ("up-clipped % (A > 0)", "actor/clip_frac_up", 100),
    ("down-clipped % (A < 0)", "actor/clip_frac_down", 100),
    ("KL to the reference", "actor/kl_ref", 1),
    ("rollout entropy", "actor/entropy", 1),
)


def signal_table(records: Path, window: int = 10) -> list[str]:
    """Per run and ``window`` steps, the means of ``SIGNAL``'s metrics from the recorded training logs."""
    lines = [f"Training signal, means over {window} steps (the runs' own logs)", ""]
    lines += [
        "| run | steps | " + " | ".join(c for c, _, _ in SIGNAL) + " |",
        "|---|---|" + "---|" * len(SIGNAL),
    ]
    for name in run_names(records):
        rows = metrics_rows(records, name)
        for lo in range(1, STEPS + 1, window):
            part = [r for r in rows if lo <= r["step"] < lo + window]
            if not part:
                continue
            cells = []
            for _, key, scale in SIGNAL:
                values = [scale * r[key] for r in part if key in r]
                cells.append(f"{sum(values) / len(values):.3f}" if values else "")
            lines.append(f"| {name} | {lo}-{part[-1]['step']} | " + " | ".join(cells) + " |")
    return lines


def entropy_table(h0: float, h: dict[str, dict[int, float]]) -> list[str]:
    lines = [f"Probe entropy H (nats) by step, and H / H(0); step 0 (the base model): H = {h0:.4f}", ""]
    lines += ["| run | " + " | ".join(str(s) for s in PROBED) + " |", "|---|" + "---|" * len(PROBED)]
    for name, by_step in h.items():
        cells = [f"{by_step[s]:.3f} ({by_step[s] / h0:.2f})" if s in by_step else "" for s in PROBED]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def probe_table(probes: dict[str, dict[int, dict]]) -> list[str]:
    """The probe's responses behind each entropy: their tokens in all (the same number of responses at
    every step), the share cut at the cap, and their accuracy. The entropy is a mean over every
    response token, so a run whose responses go on past the answer (to the cap) is measured on other
    text than one that stops: a ratio of entropies is read beside these."""
    lines = ["Probe responses by step (the same problems and sampling seeds at every step): response tokens in "
             "all / truncated % / accuracy %", ""]  # fmt: skip
    steps = [0, *PROBED]
    lines += ["| run | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for name, by_step in probes.items():
        if by_step:
            cells = [f"{p['tokens']} / {100 * p['truncated']:.0f} / {100 * p['accuracy']:.0f}"
                     if (p := by_step.get(s)) else "" for s in steps]  # fmt: skip
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def eval_table(evals: dict[tuple[str, int], dict]) -> list[str]:
    keys = ("mean@8", "maj@8", "pass@8", "truncated", "greedy")
    lines = ["Held-out, %: mean@8 / maj@8 / pass@8 / truncated (sampled: n 8, T 0.6) / greedy accuracy", ""]
    lines += [f"| run | step | {ENDPOINT_SET} (first 64) | l1_test (15) |", "|---|---|---|---|"]
    for (name, step), results in sorted(evals.items(), key=lambda x: (x[0][0] != "base", x[0])):
        cells = [
            " / ".join(f"{100 * m[k]:.1f}" if k in m else "-" for k in keys)
            for m in (results.get(ENDPOINT_SET, {}), results.get("l1_test", {}))
        ]
        lines.append(f"| {name} | {step} | " + " | ".join(cells) + " |")
    return lines


def decision(h0: float, h: dict[str, dict[int, float]], evals: dict[tuple[str, int], dict]) -> list[str]:
    """The verdict's lines once every seed's step 60 is probed and evaluated; before, ``early``'s."""
    acc = {
        (arm, s): evals.get((run_name(arm, s), STEPS), {}).get(ENDPOINT_SET, {}).get("mean@8")
        for arm in ARMS
        for s in SEEDS
    }
    done = [s for s in SEEDS if all(STEPS in h[run_name(a, s)] and acc[(a, s)] is not None for a in ARMS)]
    if len(done) < len(SEEDS):
        return early(h0, h, len(done))
    grpo60 = [h[run_name("grpo", s)][STEPS] for s in SEEDS]
    band60 = [h[run_name("bandpo", s)][STEPS] for s in SEEDS]
    ratios = [b / g for g, b in zip(grpo60, band60)]
    ratio, lo, hi = ratio_interval(ratios)
    diff, low, ok = noninferiority(
        [100 * acc[("bandpo", s)] for s in SEEDS], [100 * acc[("grpo", s)] for s in SEEDS]
    )
    return [
        f"Per seed: G = H_GRPO(60) / H(0) {', '.join(f'{g / h0:.2f}' for g in grpo60)}; R = H_BandPO(60) / "
        f"H_GRPO(60) {', '.join(f'{r:.2f}' for r in ratios)}; R's geometric mean {ratio:.2f}, 95% interval "
        f"[{lo:.2f}, {hi:.2f}].",
        f"Accuracy, BandPO - GRPO (mean@8 on {ENDPOINT_SET} at step {STEPS}, paired by seed): {diff:+.1f} "
        f"points, one-sided 95% lower end {low:+.1f}: {'non-inferior' if ok else 'non-inferiority not shown'} "
        f"at the {MARGIN:.0f}-point margin.",
        "",
        f"**Verdict: {WORDS[verdict([h0] * len(SEEDS), grpo60, band60)]} at this scale.**",
    ]


WORDS = {"holds": "the claim holds", "fails": "the claim fails", "inconclusive": "inconclusive"}


def short_of_collapse(h0: float | None, h: dict[str, dict[int, float]]) -> list[tuple[int, float]]:
    """(seed, G_s) of the GRPO seeds probed at step 60 that kept more than ``COLLAPSE`` of H(0)."""
    grpo = [(s, h[run_name("grpo", s)].get(STEPS)) for s in SEEDS]
    return [(s, x / h0) for s, x in grpo if h0 and x is not None and x / h0 > COLLAPSE]


def early(h0: float, h: dict[str, dict[int, float]], done: int) -> list[str]:
    """Before every seed is in: the paired ratios so far, and the verdict where the records already fix
    it. Both holds and fails need GRPO's collapse (G_s <= COLLAPSE) on every seed, so one GRPO seed
    probed at step 60 above it leaves inconclusive alone, whatever the other runs show."""
    at60 = {name: by_step[STEPS] for name, by_step in h.items() if STEPS in by_step}
    lines = [f"Not complete: {done} of {len(SEEDS)} seeds probed and evaluated at step {STEPS}."]
    paired = [s for s in SEEDS if all(run_name(a, s) in at60 for a in ARMS)]
    if paired:
        ratios = ", ".join(
            f"seed {s} {at60[run_name('bandpo', s)] / at60[run_name('grpo', s)]:.2f}" for s in paired
        )
        lines.append(f"R = H_BandPO(60) / H_GRPO(60) so far: {ratios}.")
    over = short_of_collapse(h0, h)
    if not over:
        return [*lines[:1], "Not decided yet.", *lines[1:]]
    s, g = over[0]
    return [
        *lines,
        f"GRPO kept G = {g:.2f} of its probe entropy at step {STEPS} on seed {s}: the rules' collapse "
        f"(G <= {COLLAPSE} on every seed) is out of reach, and both holds and fails need it, so the verdict "
        "is fixed whatever the other runs show.",
        "",
        f"**Verdict: {WORDS['inconclusive']} at this scale.**",
    ]


def report(records: Path, figure: str | None = None) -> str:
    """The section from ``records``; ``figure`` (a file name beside the report) is shown first."""
    data = collect(records)
    h0, h, evals = data["h0"], data["h"], data["evals"]
    lines = [f"{HEADING}: GRPO against BandPO, 3 seeds x {STEPS} steps", "", RULES, ""]
    if h0 is None:
        return "\n".join([*lines, "Not run yet.", ""])
    lines += [f"![headline]({figure})", ""] if figure else []
    lines += [*entropy_table(h0, h), "", *probe_table(data["probes"]), "", *eval_table(evals), ""]
    lines += [*signal_table(records), ""]
    lines += [*decision(h0, h, evals), ""]
    return "\n".join(lines)


RULES = """Settings: stage 1's, 60 steps, GRPO and BandPO (KL, delta 0.05) on seeds 0-2 (the pilot is GRPO's
seed 0, continued from its step 30), the probe entropy every 5 steps (step 0, the base model, shared),
held-out evaluations at steps 0, 30 and 60 (mean@8, maj@8, pass@8, greedy accuracy, truncation) on
the recipe's held-out set (the first 64 problems of tiny_arith_test, the probe's; the accuracy
endpoint below) and on the training mix's kind held out (the 15 level-1 one-operation problems of
tiny_arith's test split; reported). `stage2.sh` runs it; it refuses to start unless stage 1's
rule let it.

Verdict rules, fixed before the runs. R_s = H_BandPO / H_GRPO, the probe entropies at step 60 of
seed s; G_s = H_GRPO(60) / H_GRPO(0). The interval of the ratio is the two-sided 95% Student-t
interval of mean ln R_s over the 3 seeds (2 degrees of freedom, t = 4.30), exponentiated.

- **Holds** at this scale if GRPO's probe entropy fell by >= 50% (G_s <= 0.5) and R_s >= 2 on
  every seed.
- **Fails** if GRPO's entropy fell by >= 50% on every seed and the interval of the ratio lies
  below 1.5 (its upper end < 1.5): GRPO collapsed and Band did not keep what the claim says.
- **Inconclusive** otherwise (among them: GRPO did not collapse on every seed; the interval
  straddles 1.5 without every seed reaching 2).
- **Accuracy**, judged as non-inferiority: BandPO's held-out mean@8 at step 60 minus GRPO's,
  paired by seed; BandPO is non-inferior if the lower end of the one-sided 95% interval of the
  mean difference (t = 2.92 with 2 degrees of freedom) is above -10 points. Why 10: the paired
  seed-to-seed sd of mean@8 on this recipe was ~2.9 points per arm (../rivals/results-rivals.md), so the
  difference's sd is ~4.1 points and 2.92 x 4.1 / sqrt(3) = 6.9 points is the smallest margin 3
  seeds resolve; 10 leaves room for the longer runs' wider spread. A smaller margin is not claimed.

The report states one of holds / fails / inconclusive, with the per-seed table it rests on."""
