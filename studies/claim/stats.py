"""Test 1's statistics (``protocol.md``, "Test 1", with its rules fixed before any run): pure functions
on numbers, no files.

    endpoint per run     D = ln(H_probe(step 20) / H_probe(step 0))
    paired per seed      d = D_arm - D_ref        (ref: GRPO, or the no-clip control)
    interval             mean(d) -/+ t(level, n - 1) sd(d) / sqrt(n), seeds as units

Two arms of a seed are a pair only when they ran on the same machine kind (CPU name and hardware bf16)
in the same resolved precision (protocol: "a pair split across kinds is run again"); a split pair is
listed and left out. Rule 2's classes: **raises** (interval above 0), **lowers** (below 0), **no
difference of 0.10 or more** (within (-0.10, 0.10)), **inconclusive** otherwise. Decisions use 97.5%
intervals at both looks (5 seeds, and 8 if the extension rule calls for it: "the first look also uses
97.5%"); the 95% interval is shown beside. With fewer than 5 complete pairs the comparison is interim:
numbers, no class. Student-t quantiles are the entropy study's (no scipy: the exact two-sided t
probability for integer degrees of freedom, inverted by bisection).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from studies.entropy.stats import t_quantile

DECISION_LEVEL = 0.975  # protocol, "Power": two looks, each at 97.5% ("the first look also uses 97.5%")
SHOWN_LEVEL = 0.95  # the level the rules were first written at, shown beside
MARGIN = 0.10  # rule 2: "no difference of 0.10 or more" (10% in entropy after 20 steps)
FIRST_LOOK = 5  # seeds 0-4
SECOND_LOOK = 8  # seeds 5-7 of the extension
SIGMA_MAX = 0.060  # the extension rule: run seeds 5-7 when the sample sd of d is above this
EXTENSION_ARMS = ("grpo", "bandpo", "no_clip")
EXTENSION_SEEDS = (5, 6, 7)

RAISES, LOWERS, NO_DIFFERENCE, INCONCLUSIVE = (
    "raises",
    "lowers",
    "no difference of 0.10 or more",
    "inconclusive",
)


@dataclass(frozen=True)
class Interval:
    """The mean of ``n`` values, their sample sd and the two-sided ``level`` interval of the mean
    (sd, lo and hi are None with one value: no spread, no interval)."""

    n: int
    level: float
    mean: float
    sd: float | None
    lo: float | None
    hi: float | None


def interval(values: Sequence[float], level: float) -> Interval:
    """mean -/+ t(level, n - 1) sd / sqrt(n), seeds as units (protocol, rule 1)."""
    n = len(values)
    if n == 0:
        raise ValueError("interval: no values")
    mean = sum(values) / n
    if n == 1:
        return Interval(1, level, mean, None, None, None)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return Interval(n, level, mean, sd, mean - half, mean + half)


def log_change(h0: float, h20: float) -> float:
    """D = ln(H_probe(20) / H_probe(0)): the fixed-text entropy's log change (protocol: the endpoint)."""
    for name, h in (("step 0", h0), ("the last step", h20)):
        if not (isinstance(h, int | float) and math.isfinite(h) and h > 0):
            raise ValueError(f"probe entropy at {name} must be a positive number, got {h!r}")
    return math.log(h20 / h0)


@dataclass(frozen=True)
class Endpoint:
    """One run's D and what pairing needs of it: the machine kind and the resolved precision."""

    arm: str
    seed: int
    D: float
    machine: tuple[str, bool]  # (CPU name, multiplies bf16 in hardware)
    precision: str  # "bf16" | "fp32"


@dataclass(frozen=True)
class Split:
    """A seed whose two runs ran on another machine kind or precision: listed, not used."""

    seed: int
    arm: Endpoint
    ref: Endpoint

    @property
    def reason(self) -> str:
        parts = []
        if self.arm.machine != self.ref.machine:
            parts.append(f"machine {self.arm.machine} vs {self.ref.machine}")
        if self.arm.precision != self.ref.precision:
            parts.append(f"precision {self.arm.precision} vs {self.ref.precision}")
        return "; ".join(parts)


def pairs(arm: Mapping[int, Endpoint], ref: Mapping[int, Endpoint]) -> tuple[dict[int, float], list[Split]]:
    """``({seed: d = D_arm - D_ref}, splits)`` over the seeds both arms have; a seed whose runs differ in
    machine kind or precision is a split (protocol: "a pair split across kinds is run again")."""
    d, splits = {}, []
    for seed in sorted(set(arm) & set(ref)):
        a, r = arm[seed], ref[seed]
        if a.machine != r.machine or a.precision != r.precision:
            splits.append(Split(seed, a, r))
        else:
            d[seed] = a.D - r.D
    return d, splits


def classify(iv: Interval, margin: float = MARGIN) -> str | None:
    """Rule 2 on an interval, in the protocol's order: above 0 raises, below 0 lowers, within
    (-margin, margin) no difference of the margin or more, inconclusive otherwise; None without one."""
    if iv.lo is None or iv.hi is None:
        return None
    if iv.lo > 0:
        return RAISES
    if iv.hi < 0:
        return LOWERS
    if -margin < iv.lo and iv.hi < margin:
        return NO_DIFFERENCE
    return INCONCLUSIVE


def look(n: int) -> tuple[str, int]:
    """``("first" | "second", n)`` at 5 and 8 complete pairs, else ``("interim", target)``: the look the
    pairs so far are short of (5, or 8 once past 5: the extension under way)."""
    if n == FIRST_LOOK:
        return "first", n
    if n >= SECOND_LOOK:
        return "second", n
    return "interim", FIRST_LOOK if n < FIRST_LOOK else SECOND_LOOK


@dataclass(frozen=True)
class Comparison:
    """One paired comparison: d per seed, the splits left out, both intervals (None with no pair), the
    look, and the class at the decision level (None while interim or with one pair)."""

    arm: str
    ref: str
    d: dict[int, float]
    splits: list[Split]
    decision: Interval | None  # at DECISION_LEVEL
    shown: Interval | None  # at SHOWN_LEVEL
    look: tuple[str, int]
    verdict: str | None

    @property
    def interim(self) -> bool:
        return self.look[0] == "interim"


def compare(arm: str, ref: str, endpoints: Sequence[Endpoint]) -> Comparison:
    """``arm`` against ``ref`` over the runs in ``endpoints`` (any arms; the two are picked out)."""
    by = {name: {e.seed: e for e in endpoints if e.arm == name} for name in (arm, ref)}
    d, splits = pairs(by[arm], by[ref])
    values = [d[s] for s in sorted(d)]
    decision = interval(values, DECISION_LEVEL) if values else None
    shown = interval(values, SHOWN_LEVEL) if values else None
    stage = look(len(values))
    verdict = None if stage[0] == "interim" or decision is None else classify(decision)
    return Comparison(arm, ref, d, splits, decision, shown, stage, verdict)


def sensitivity(grpo_vs_no_clip: Comparison) -> bool | None:
    """Rule 1: whether a clip's own effect was visible (GRPO's D differs from the no-clip control's: the
    interval of D_GRPO - D_no-clip excludes 0); None while interim. When False, every comparison is
    descriptive."""
    c = grpo_vs_no_clip
    if c.interim or c.decision is None or c.decision.lo is None:
        return None
    return c.decision.lo > 0 or c.decision.hi < 0


def extension(band_vs_grpo: Comparison) -> bool | None:
    """The 8-seed rule, on the first look's seeds (0-4) whatever has run since: rule 2 inconclusive at
    97.5% and the sample sd of d above 0.060 -> run seeds 5-7 of GRPO, BandPO and no-clip
    (``EXTENSION_ARMS``, ``EXTENSION_SEEDS``). None while seeds 0-4 are not all paired."""
    first = [band_vs_grpo.d[s] for s in range(FIRST_LOOK) if s in band_vs_grpo.d]
    if len(first) < FIRST_LOOK:
        return None
    iv = interval(first, DECISION_LEVEL)
    return classify(iv) == INCONCLUSIVE and iv.sd is not None and iv.sd > SIGMA_MAX
