"""studies/claim/learn_stats.py: Test 2's gate, endpoints and verdict on hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from studies.claim import learn_stats as ls
from studies.claim.stats import DECISION_LEVEL, Interval, t_quantile

STEPS = range(1, 41)


def _gate(acc: float, zero: float, h_first: float, h_last: float) -> list[ls.Check]:
    rollout = {s: h_first if s <= 5 else h_last for s in STEPS}
    return ls.pilot_gate({s: acc for s in STEPS}, {s: zero for s in STEPS}, rollout)


def test_a_pilot_in_the_band_with_signal_left_and_entropy_lost_passes():
    # accuracy 0.30 in [0.20, 0.45]; 1 - 0.70 = 0.30 of groups with advantage >= 0.25; 0.35 / 0.50 = 0.70 <= 0.8
    checks = _gate(0.30, 0.70, 0.50, 0.35)
    assert [c.passed for c in checks] == [True, True, True]
    assert [round(c.value, 12) for c in checks] == [0.30, 0.30, 0.70]


@pytest.mark.parametrize(
    ("acc", "zero", "last", "failing"),
    [
        (0.15, 0.70, 0.35, 0),  # too hard at the start
        (0.46, 0.70, 0.35, 0),  # too easy
        (0.30, 0.80, 0.35, 1),  # 0.20 of groups with advantage: the pool ran out
        (0.30, 0.70, 0.45, 2),  # 0.45 / 0.50 = 0.9 > 0.8: nothing to keep
    ],
)
def test_each_check_fails_on_its_own(acc, zero, last, failing):
    checks = _gate(acc, zero, 0.50, last)
    assert [i for i, c in enumerate(checks) if not c.passed] == [failing]


def test_the_gate_windows_are_the_protocols():
    # accuracy 1.0 outside steps 1-3 and 0.30 inside: only steps 1-3 count
    acc = {s: 0.30 if s <= 3 else 1.0 for s in STEPS}
    zero = {s: 0.70 if s >= 36 else 0.0 for s in STEPS}  # only steps 36-40 count
    rollout = {s: 0.50 if s <= 5 else (0.35 if s >= 31 else 9.0) for s in STEPS}  # 1-5 and 31-40
    assert [round(c.value, 12) for c in ls.pilot_gate(acc, zero, rollout)] == [0.30, 0.30, 0.70]


def test_a_missing_step_names_the_series_and_the_window():
    with pytest.raises(ValueError, match=r"actor/entropy: steps \[33\] not logged \(window 31-40\)"):
        ls.pilot_gate({s: 0.3 for s in STEPS}, {s: 0.7 for s in STEPS}, {s: 0.5 for s in STEPS if s != 33})


def _ends(arm, seed, rollout, first_n, probe, ev, machine=("cpu", True), precision="fp32"):
    return ls.Ends(arm, seed, rollout, first_n, probe, ev, machine, precision)


def test_a_pair_by_hand():
    # r = ln(0.6 / 0.3) = ln 2, f = ln(0.45 / 0.30) = ln 1.5, length = ln(0.4 / 0.5) = ln 0.8, a = 100 (0.30 - 0.25)
    p = ls.pair(_ends("bandpo", 0, 0.6, 0.4, 0.45, 0.30), _ends("grpo", 0, 0.3, 0.5, 0.30, 0.25))
    assert p.r == pytest.approx(math.log(2), rel=1e-15)
    assert p.f == pytest.approx(math.log(1.5), rel=1e-15)
    assert p.length == pytest.approx(math.log(0.8), rel=1e-15)
    assert p.a == pytest.approx(5.0, abs=1e-12)  # 100 x (0.30 - 0.25) in doubles: ~1e-14 off 5


def _iv(lo: float, hi: float) -> Interval:
    return Interval(5, DECISION_LEVEL, (lo + hi) / 2, 0.1, lo, hi)


@pytest.mark.parametrize(
    ("r", "f", "length", "a", "verdict"),
    [
        ((0.3, 0.9), (0.1, 0.5), (0.1, 0.5), (-4.0, 3.0), ls.HOLDS),
        ((0.3, 0.9), (0.1, 0.5), (-0.1, 0.5), (-4.0, 3.0), "holds, not separated from length"),
        ((0.05, 0.2), (0.1, 0.5), (0.1, 0.5), (-4.0, 3.0), "holds, a keep under 1.25x"),  # ln 1.25 = 0.223
        (
            (0.05, 0.2),
            (0.1, 0.5),
            (-0.1, 0.5),
            (-4.0, 3.0),
            "holds, not separated from length, a keep under 1.25x",
        ),
        ((0.3, 0.9), (-0.1, 0.5), (0.1, 0.5), (-4.0, 3.0), ls.INCONCLUSIVE),  # f's interval includes 0
        ((0.3, 0.9), (0.1, 0.5), (0.1, 0.5), (-6.0, 3.0), ls.INCONCLUSIVE),  # non-inferiority not shown
        ((-0.3, 0.2), (0.1, 0.5), (0.1, 0.5), (-4.0, 3.0), ls.FAILS),  # 0.2 < ln 1.25: a 25% keep ruled out
        ((-0.3, 0.3), (0.1, 0.5), (0.1, 0.5), (-9.0, -5.5), ls.FAILS),  # accuracy inferior
        ((-0.3, 0.3), (0.1, 0.5), (0.1, 0.5), (-4.0, 3.0), ls.INCONCLUSIVE),
    ],
)
def test_the_verdict_classes_in_the_order_written(r, f, length, a, verdict):
    assert ls.decide(_iv(*r), _iv(*f), _iv(*length), _iv(*a)) == verdict


def _five(r_values, a=0.0, machine=("cpu", True)):
    # GRPO: rollout 0.3, first-n 0.3, probe 0.3, eval 0.25; Band: the same times exp(r) (r, f and the length
    # check all equal r up to 1e-16), eval 0.25 + a / 100
    out = []
    for seed, r in enumerate(r_values):
        out.append(_ends("grpo", seed, 0.3, 0.3, 0.3, 0.25))
        h = 0.3 * math.exp(r)
        out.append(_ends("bandpo", seed, h, h, h, 0.25 + a / 100, machine=machine))
    return out


def test_five_seeds_decide_at_97_5_percent():
    r = [0.1, 0.2, 0.3, 0.4, 0.5]  # mean 0.3, sd sqrt(0.025)
    v = ls.compare(_five(r))
    half = t_quantile(DECISION_LEVEL, 4) * math.sqrt(0.025) / math.sqrt(5)  # ~0.247 (t 3.50)
    assert v.look == ("first", 5) and not v.splits
    assert v.r.mean == pytest.approx(0.3, abs=1e-12)
    assert (v.r.lo, v.r.hi) == pytest.approx((0.3 - half, 0.3 + half), abs=1e-12)
    assert v.shown["r"].level == 0.95 and v.shown["r"].hi < v.r.hi
    # r's interval [0.053, 0.547] above 0 but not below ln 1.25; a = 0 exactly: holds
    assert v.verdict == ls.HOLDS and ls.extension(v) is False


def test_an_inconclusive_first_look_with_r_above_0_calls_for_the_extension():
    v = ls.compare(_five([-0.2, 0.0, 0.2, 0.4, 0.6]))  # mean 0.2, interval includes 0 and ln 1.25
    assert v.verdict == ls.INCONCLUSIVE and ls.extension(v) is True
    v = ls.compare(_five([0.2, 0.0, -0.2, -0.4, 0.3]))  # mean -0.02: no extension
    assert v.verdict == ls.INCONCLUSIVE and ls.extension(v) is False


def test_interim_and_split_pairs():
    ends = _five([0.1, 0.2, 0.3])
    ends += [_ends("grpo", 3, 0.3, 0.3, 0.3, 0.25), _ends("bandpo", 3, 0.3, 0.3, 0.3, 0.25, precision="bf16")]
    v = ls.compare(ends)
    assert v.look == ("interim", 5) and v.verdict is None and [p.seed for p in v.pairs] == [0, 1, 2]
    assert [seed for seed, _ in v.splits] == [3] and "precision bf16 vs fp32" in v.splits[0][1]
    assert ls.extension(v) is None
