"""Stage 0's statistics and report, from its trial records alone (no torch, no runs).

A trial is one paired per-update test: from one state and one rollout batch, one update under
GRPO and one under BandPO, the policy's probe entropy before (H0, shared) and after each (Hg, Hb).

    change of log-entropy per update   dg = ln Hg - ln H0,   db = ln Hb - ln H0
    paired difference                  d  = db - dg  (= ln Hb - ln Hg: H0 cancels)

The endpoint is the mean of d over trials, with its two-sided 95% Student-t interval (n - 1
degrees of freedom), per state and over all trials. A BandPO / GRPO entropy ratio of 2 after 60
steps needs the per-step log-ratios to add up to ln 2, a mean d of at least ln 2 / 60 = 0.01155
(about 1.2% a step): ``THRESHOLD``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

STEPS = 60  # stage 2's run length
TARGET_RATIO = 2.0  # the entropy ratio BandPO / GRPO stage 2 is to show
THRESHOLD = math.log(TARGET_RATIO) / STEPS  # 0.011552: the mean d a 2x ratio after 60 steps needs
ARMS = ("grpo", "bandpo")
MEASURES = {
    "own": "the policy's own samples of the probe prompts (the same sampling seeds before and after)",
    "fixed": "the probe samples drawn before the update, scored again by the updated policy",
}


def t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` (a positive integer) degrees of freedom, exact.

    The finite series in theta = atan(t / sqrt(df)) for integer degrees of freedom (Abramowitz and
    Stegun 26.7.3-4): odd df, (2/pi)(theta + sin cos (1 + 2/3 cos^2 + (2 4)/(3 5) cos^4 + ...)) up to
    cos^(df-3); even df, sin (1 + 1/2 cos^2 + (1 3)/(2 4) cos^4 + ...) up to cos^(df-2).
    """
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df!r}")
    if t <= 0:
        return 0.0
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for k in range(2, df - 1, 2):  # terms up to cos^(df-2)
            term *= c2 * (k - 1) / k
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0
    for k in range(3, df - 1, 2):  # terms up to cos^(df-3)
        term *= c2 * (k - 1) / k
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| < t) = ``level`` (2.5706 for 0.95 and 5 degrees of freedom), by bisection to 1e-12."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) < level:
        hi *= 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values, their sample standard deviation, and the two-sided t interval of the mean
    (``lo`` = ``hi`` = None with one value: no spread to judge by)."""

    n: int
    mean: float
    sd: float | None
    lo: float | None
    hi: float | None


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of ``values`` and its ``level`` interval: mean -/+ t(level, n - 1) sd / sqrt(n)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = sum(values) / n
    if n == 1:
        return Interval(1, mean, None, None, None)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return Interval(n, mean, sd, mean - half, mean + half)


def log_changes(h0: float, hg: float, hb: float) -> tuple[float, float, float]:
    """``(dg, db, d)``: each arm's change of log-entropy and their paired difference (module docstring)."""
    for name, h in (("before", h0), ("grpo", hg), ("bandpo", hb)):
        if not h > 0 or not math.isfinite(h):
            raise ValueError(f"probe entropy {name} must be a positive number, got {h!r}")
    dg, db = math.log(hg / h0), math.log(hb / h0)
    return dg, db, db - dg


def verdict(interval: Interval, threshold: float = THRESHOLD) -> str:
    """``below``: the interval lies under the threshold (a 2x ratio after 60 steps is out of reach);
    ``above``: it lies over it; ``includes``: it holds the threshold; ``n/a``: one trial, no interval."""
    if interval.lo is None:
        return "n/a"
    if interval.hi < threshold:
        return "below"
    if interval.lo >= threshold:
        return "above"
    return "includes"


def trial_changes(record: dict, measure: str = "own") -> tuple[float, float, float]:
    """``log_changes`` of a trial record (``stage0.py``'s JSON) under ``measure`` (``MEASURES``)."""
    key = "entropy" if measure == "own" else "entropy_fixed"
    try:
        return log_changes(
            record["probe"]["entropy_before"],
            record["arms"]["grpo"][key],
            record["arms"]["bandpo"][key],
        )
    except KeyError as e:
        raise ValueError(
            f"trial record {record.get('state')}/b{record.get('batch')} lacks {e}: not a stage 0 record"
        ) from None


def summarise(records: Iterable[dict], measure: str = "own") -> dict[str, dict[str, Interval]]:
    """Per state (in first-seen order) and ``all``: the intervals of ``dg``, ``db`` and ``d``."""
    groups: dict[str, list[tuple[float, float, float]]] = {}
    for r in records:
        groups.setdefault(r["state"], []).append(trial_changes(r, measure))
    every = [c for changes in groups.values() for c in changes]
    if not every:
        raise ValueError("no stage 0 trial records")
    out = {}
    for name, changes in [*groups.items(), ("all", every)]:
        out[name] = {k: mean_interval([c[i] for c in changes]) for i, k in enumerate(("dg", "db", "d"))}
    return out


def overall_verdict(per_state: dict[str, str]) -> str:
    """The stage's verdict line from each state's ``verdict`` of ``d`` (``all`` excluded)."""
    states = {k: v for k, v in per_state.items() if k != "all"}
    if states and all(v == "below" for v in states.values()):
        return (
            "**At every state the interval lies below the threshold: BandPO's per-update gain in "
            "entropy cannot add up to 2x in 60 steps at this scale, and stage 2 is not run.**"
        )
    if any(v == "n/a" for v in states.values()):
        return "**No verdict: a state has fewer than 2 trials.**"
    above = sorted(k for k, v in states.items() if v == "above")
    if above:
        return (
            f"**At {', '.join(above)} the interval lies above the threshold: a 2x ratio after 60 steps is "
            f"within reach per update, and stage 2 may go on.**"
        )
    return (
        "**Not every interval lies below the threshold: stage 0 does not rule a 2x ratio out, and stage "
        "2 may go on.**"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _clips(arm: dict) -> str:
    u = arm.get("update", {})
    if "clip_frac_up" not in u:
        return "-"
    return f"{100 * u['clip_frac_up']:.2f}% / {100 * u['clip_frac_down']:.2f}%"


def _row(name: str, intervals: dict[str, Interval], threshold: float) -> str:
    d = intervals["d"]
    ci = "-" if d.lo is None else f"[{_pct(d.lo)}, {_pct(d.hi)}]"
    return (
        f"| {name} | {d.n} | {_pct(intervals['dg'].mean)} | {_pct(intervals['db'].mean)} | "
        f"**{_pct(d.mean)}** | {ci} | {_pct(threshold)} | {verdict(d, threshold)} |"
    )


RULES = f"""Verdict rules (fixed before the runs): the endpoint is the mean over trials of the paired
difference d = (ln H_after,BandPO - ln H_before) - (ln H_after,GRPO - ln H_before), with its two-sided
95% Student-t interval (trials as the unit, n - 1 degrees of freedom), per state and over all trials.
A BandPO / GRPO entropy ratio of {TARGET_RATIO:g} after {STEPS} steps needs the per-step log-ratios to add
up to ln {TARGET_RATIO:g}: a mean d of at least ln {TARGET_RATIO:g} / {STEPS} = {THRESHOLD:.5f} (about 1.2% a step).
Per state: **below** when the interval's upper end is under that threshold (from this state a 2x ratio
is out of reach), **above** when its lower end is over it, **includes** otherwise. If every state is
below, stage 2 cannot show 2x and is not run; the report says so instead."""


def report(records: Sequence[dict], threshold: float = THRESHOLD) -> str:
    """The markdown of stage 0's section from its trial records: rules, then the tables, then the verdict."""
    records = sorted(records, key=lambda r: (r.get("state_order", 0), r["batch"]))
    lines = ["## Stage 0: the paired per-update test", "", RULES, ""]
    first = records[0]
    s = first.get("settings", {})
    lines += [
        f"{len(records)} trials: states {', '.join(dict.fromkeys(r['state'] for r in records))}; "
        f"each trial one rollout batch ({s.get('batch', '?')}) and one update of each arm from the same "
        f"weights and optimizer state ({s.get('update', '?')}); probe entropy: mean per-token entropy "
        f"of the policy at the rollout temperature over {s.get('probe', '?')}.",
        "",
    ]
    verdicts = {}
    for measure, what in MEASURES.items():
        summary = summarise(records, measure)
        head = "Primary endpoint" if measure == "own" else "Secondary (same weights, other probe)"
        lines += [
            f"### {head}: entropy of {what}",
            "",
            "| state | trials | GRPO dlnH / update | BandPO dlnH / update | d = BandPO - GRPO | 95% interval of d "
            "| threshold | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [_row(name, iv, threshold) for name, iv in summary.items()]
        lines.append("")
        if measure == "own":
            verdicts = {name: verdict(iv["d"], threshold) for name, iv in summary.items()}
    lines += [overall_verdict(verdicts), ""]
    lines += [
        "### Trials",
        "",
        "Clipped: the update's share of tokens clipped up (A > 0) / down (A < 0), over its optimizer steps.",
        "",
        "| state | batch | accuracy | H before | H GRPO | H BandPO | d | clipped GRPO | clipped BandPO | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        _, _, d = trial_changes(r)
        a = r["arms"]
        lines.append(
            f"| {r['state']} | {r['batch']} | {r['batch_stats']['accuracy']:.3f} | "
            f"{r['probe']['entropy_before']:.4f} | {a['grpo']['entropy']:.4f} | {a['bandpo']['entropy']:.4f} | "
            f"{_pct(d)} | {_clips(a['grpo'])} | {_clips(a['bandpo'])} | {r.get('wall_s', 0) / 60:.1f} |"
        )
    return "\n".join(lines) + "\n"


def replace_section(document: str, section: str, heading: str = "## Stage 0") -> str:
    """``document`` with the part from ``heading`` to the next ``## `` heading replaced by ``section``;
    without one, ``section`` goes before the first ``## Stage`` heading (the later stages), else at the end."""
    lines = document.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.startswith(heading)), None)
    if start is None:
        later = next((i for i, ln in enumerate(lines) if ln.startswith("## Stage")), None)
        if later is not None:
            return "".join(lines[:later]) + section + "\n" + "".join(lines[later:])
        body = document.rstrip("\n")
        return (body + "\n\n" if body else "") + section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + tail if tail else "")


TITLE = "# smollm2_arith: does Band keep the policy's entropy where GRPO loses it?\n\n"


def load_records(folder: Path) -> list[dict]:
    """The trial records (``<state>-b<batch>.json``) of a records folder."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*-b*.json"))]


def write_report(records_dir: Path, out: Path) -> str:
    """Stage 0's section of ``out`` (made with ``TITLE`` if missing) rebuilt from the records; returns it."""
    records = load_records(records_dir)
    if not records:
        raise SystemExit(f"no trial records in {records_dir}")
    return write_section(out, report(records))


def write_section(out: Path, section: str, heading: str = "## Stage 0") -> str:
    """``section`` in place of ``out``'s part under ``heading`` (``replace_section``), written atomically;
    ``out`` is made with ``TITLE`` if missing. Returns ``section``."""
    from bandpo.checkpoint.atomic import write_text_atomic

    document = out.read_text() if out.exists() else TITLE
    write_text_atomic(out, replace_section(document, section, heading))
    return section
