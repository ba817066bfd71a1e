"""Test 2's statistics (``protocol.md``, "Test 2", rules fixed before any run; amendment 4 for the order of
the verdict's classes): pure functions on numbers, no files.

    pilot gate           accuracy over steps 1-3 in [20%, 45%]; groups with advantage over steps 36-40
                         >= 25%; rollout entropy over steps 31-40 <= 0.8 x its mean over steps 1-5
    endpoints per seed   r = ln(mean rollout entropy, steps 31-40: BandPO / GRPO)     (primary)
                         f = ln(H_probe(40): BandPO / GRPO)                           (co-primary)
                         r on entropy/ended_first_n                                   (length check)
                         a = held-out mean@8 at step 40, BandPO - GRPO, in points     (non-inferiority)
    verdict              holds: r and f above 0 and a above -5 (97.5% intervals, seeds as units);
                         fails: r below ln 1.25, or a below -5; inconclusive otherwise

Pairs are formed as in Test 1 (``stats``): only between runs of one machine kind in one precision. Both
looks (5 seeds, and 8 if the extension rule calls for it) decide at 97.5%; 95% is shown beside. With
fewer than 5 complete pairs the comparison is interim: numbers, no verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from studies.claim.stats import DECISION_LEVEL, FIRST_LOOK, SHOWN_LEVEL, Interval, interval, look

STEPS = 40
LAST = range(31, 41)  # "the last 10 steps": the primary's window and the gate's entropy window
FIRST = range(1, 6)  # the gate's entropy reference: steps 1-5
EARLY = range(1, 4)  # the gate's accuracy window: steps 1-3
END = range(36, 41)  # the gate's signal window: steps 36-40
ACCURACY_BAND = (0.20, 0.45)
SIGNAL_MIN = 0.25
KEEP_MAX = 0.8
KEEP_FLOOR = math.log(1.25)  # fails: "a 25% keep is ruled out"
NON_INFERIORITY = -5.0  # points of held-out mean@8

HOLDS, FAILS, INCONCLUSIVE = "holds", "fails", "inconclusive"
# qualifiers of "holds" (amendment 4): "holds, not separated from length, a keep under 1.25x" at most
NOT_SEPARATED, SMALL = "not separated from length", "a keep under 1.25x"


def window_mean(series: Mapping[int, float], steps: range, what: str) -> float:
    """The mean of ``series`` over ``steps``; every step must be logged (a missing one is an error naming it)."""
    missing = [s for s in steps if s not in series]
    if missing:
        raise ValueError(f"{what}: steps {missing} not logged (window {steps.start}-{steps.stop - 1})")
    return sum(series[s] for s in steps) / len(steps)


@dataclass(frozen=True)
class Check:
    name: str
    value: float
    bound: str  # what it must satisfy, in words
    passed: bool


def pilot_gate(
    accuracy: Mapping[int, float], zero_signal: Mapping[int, float], rollout: Mapping[int, float]
) -> list[Check]:
    """The pilot's three checks (protocol, Test 2, "Pilot"): ``accuracy`` is ``reward/accuracy``,
    ``zero_signal`` is ``adv/zero_signal_group_frac`` (groups whose rewards are all alike) and ``rollout``
    is ``actor/entropy``, each by step. The pilot passes when all three pass."""
    acc = window_mean(accuracy, EARLY, "reward/accuracy")
    signal = 1.0 - window_mean(zero_signal, END, "adv/zero_signal_group_frac")
    keep = window_mean(rollout, LAST, "actor/entropy") / window_mean(rollout, FIRST, "actor/entropy")
    lo, hi = ACCURACY_BAND
    return [
        Check("training accuracy, steps 1-3", acc, f"within {lo:.0%}-{hi:.0%}", lo <= acc <= hi),
        Check("groups with advantage, steps 36-40", signal, f">= {SIGNAL_MIN:.0%}", signal >= SIGNAL_MIN),
        Check("rollout entropy, steps 31-40 over steps 1-5", keep, f"<= {KEEP_MAX:g}", keep <= KEEP_MAX),
    ]


@dataclass(frozen=True)
class Ends:
    """One run's numbers for the endpoints, with what pairing needs (as ``stats.Endpoint``)."""

    arm: str
    seed: int
    rollout_last: float  # mean actor/entropy over steps 31-40
    first_n_last: float  # mean entropy/ended_first_n over steps 31-40
    probe_end: float  # probe/entropy at step 40
    eval_end: float  # held-out mean@8 at step 40, a fraction
    machine: tuple[str, bool]
    precision: str


@dataclass(frozen=True)
class Pair:
    seed: int
    r: float
    f: float
    length: float
    a: float  # points


def pair(band: Ends, grpo: Ends) -> Pair:
    for name, x, y in (
        ("rollout entropy", band.rollout_last, grpo.rollout_last),
        ("first-n entropy", band.first_n_last, grpo.first_n_last),
        ("probe entropy", band.probe_end, grpo.probe_end),
    ):
        if not (x > 0 and y > 0):
            raise ValueError(f"seed {band.seed}: {name} must be positive in both arms, got {x!r}, {y!r}")
    return Pair(
        band.seed,
        math.log(band.rollout_last / grpo.rollout_last),
        math.log(band.probe_end / grpo.probe_end),
        math.log(band.first_n_last / grpo.first_n_last),
        100.0 * (band.eval_end - grpo.eval_end),
    )


@dataclass(frozen=True)
class Verdict:
    pairs: list[Pair]
    splits: list[tuple[int, str]]  # (seed, why): left out, to be run again
    look: tuple[str, int]
    r: Interval | None  # at DECISION_LEVEL; the shown (95%) ones beside
    f: Interval | None
    length: Interval | None
    a: Interval | None
    shown: dict[str, Interval]
    verdict: str | None  # None while interim

    @property
    def interim(self) -> bool:
        return self.look[0] == "interim"


def decide(r: Interval, f: Interval, length: Interval, a: Interval) -> str:
    """The verdict's classes in the order written (amendment 4): holds (qualified when the length check's
    interval includes 0, and when r's lies below ln 1.25 as well), then fails, else inconclusive."""
    if r.lo is None or f.lo is None or a.lo is None or length.lo is None:
        raise ValueError("decide: intervals need 2 pairs or more")
    if r.lo > 0 and f.lo > 0 and a.lo > NON_INFERIORITY:
        qualified = [HOLDS]
        if length.lo <= 0 <= length.hi:
            qualified.append(NOT_SEPARATED)
        if r.hi < KEEP_FLOOR:
            qualified.append(SMALL)
        return ", ".join(qualified)
    if r.hi < KEEP_FLOOR or a.hi < NON_INFERIORITY:
        return FAILS
    return INCONCLUSIVE


def compare(ends: Sequence[Ends], band: str = "bandpo", grpo: str = "grpo") -> Verdict:
    by = {name: {e.seed: e for e in ends if e.arm == name} for name in (band, grpo)}
    pairs, splits = [], []
    for seed in sorted(set(by[band]) & set(by[grpo])):
        b, g = by[band][seed], by[grpo][seed]
        if b.machine != g.machine or b.precision != g.precision:
            splits.append(
                (seed, f"machine {b.machine} vs {g.machine}, precision {b.precision} vs {g.precision}")
            )
        else:
            pairs.append(pair(b, g))
    stage = look(len(pairs))
    if not pairs:
        return Verdict(pairs, splits, stage, None, None, None, None, {}, None)
    values = {k: [getattr(p, k) for p in pairs] for k in ("r", "f", "length", "a")}
    at = {k: interval(v, DECISION_LEVEL) for k, v in values.items()}
    shown = {k: interval(v, SHOWN_LEVEL) for k, v in values.items()}
    verdict = None if stage[0] == "interim" else decide(at["r"], at["f"], at["length"], at["a"])
    return Verdict(pairs, splits, stage, at["r"], at["f"], at["length"], at["a"], shown, verdict)


def extension(v: Verdict) -> bool | None:
    """The 8-seed rule on seeds 0-4: inconclusive at 97.5% and mean r above 0 -> run seeds 5-7 of both
    arms; None while seeds 0-4 are not all paired."""
    first = [p for p in v.pairs if p.seed < FIRST_LOOK]
    if len(first) < FIRST_LOOK:
        return None
    at = {k: interval([getattr(p, k) for p in first], DECISION_LEVEL) for k in ("r", "f", "length", "a")}
    return decide(at["r"], at["f"], at["length"], at["a"]) == INCONCLUSIVE and at["r"].mean > 0
