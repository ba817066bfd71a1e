"""studies/claim/stats.py: Test 1's numbers and rules, checked against numbers computed by hand."""

from __future__ import annotations

import math

import pytest

from studies.claim import stats

M = ("AMD EPYC 7B13", False)  # one machine kind


def ends(arm: str, ds: dict[int, float], machine=M, precision="fp32") -> list[stats.Endpoint]:
    return [stats.Endpoint(arm, s, D, machine, precision) for s, D in ds.items()]


def paired(d: list[float]) -> list[stats.Endpoint]:
    """GRPO at D = 0 on every seed and Band at D = d_s, so that d_s is the paired difference exactly."""
    return ends("grpo", dict.fromkeys(range(len(d)), 0.0)) + ends("bandpo", dict(enumerate(d)))


@pytest.mark.parametrize(
    ("level", "df", "table"),
    [
        # two-sided levels; printed tables' upper quantiles t(0.975, df) and t(0.9875, df), to 3-4 decimals
        (0.95, 1, 12.7062),
        (0.975, 1, 25.4517),
        (0.95, 4, 2.7764),
        (0.975, 4, 3.4954),
        (0.95, 7, 2.3646),
        (0.975, 7, 2.8412),
        (0.95, 10, 2.2281),
    ],
)
def test_t_quantiles_are_the_tables(level, df, table):
    # the tables round to 4 decimals: |error| <= 5e-5
    assert stats.t_quantile(level, df) == pytest.approx(table, abs=5e-5)


def test_t_quantile_refuses_what_has_none():
    with pytest.raises(ValueError):
        stats.t_quantile(0.95, 0)
    with pytest.raises(ValueError):
        stats.t_quantile(1.0, 4)


def test_log_change_and_paired_d_by_hand():
    # arm: H 2.0 -> 1.0, D = ln 0.5 = -0.693147; reference: 2.0 -> 1.6, D = ln 0.8 = -0.223144;
    # d = ln(0.5 / 0.8) = ln 0.625 = -0.470004 (exact up to float rounding: 1e-12)
    da, dr = stats.log_change(2.0, 1.0), stats.log_change(2.0, 1.6)
    assert da == pytest.approx(-0.693147, abs=1e-6)
    d, splits = stats.pairs({0: ends("bandpo", {0: da})[0]}, {0: ends("grpo", {0: dr})[0]})
    assert splits == [] and d[0] == pytest.approx(math.log(0.625), abs=1e-12)
    assert d[0] == pytest.approx(-0.470004, abs=1e-6)
    with pytest.raises(ValueError, match="positive"):
        stats.log_change(0.0, 1.0)


def test_interval_by_hand():
    # d = 0.1 .. 0.5: mean 0.3; squared deviations 0.04 + 0.01 + 0 + 0.01 + 0.04 = 0.10, sd = sqrt(0.10 / 4)
    # = 0.158114; se = sd / sqrt 5 = 0.0707107. 95%: 2.7764 x 0.0707107 = 0.196322 -> [0.103678, 0.496322];
    # 97.5%: 3.4954 x 0.0707107 = 0.247162 -> [0.052838, 0.547162]. The table's t is rounded to 5e-5,
    # which moves a bound by at most 5e-5 x 0.0707 = 3.5e-6: tolerance 1e-5.
    iv95, iv975 = (
        stats.interval([0.1, 0.2, 0.3, 0.4, 0.5], 0.95),
        stats.interval([0.1, 0.2, 0.3, 0.4, 0.5], 0.975),
    )
    assert (iv95.n, iv95.mean, iv95.sd) == (5, pytest.approx(0.3), pytest.approx(0.158114, abs=1e-6))
    assert (iv95.lo, iv95.hi) == (pytest.approx(0.103678, abs=1e-5), pytest.approx(0.496322, abs=1e-5))
    assert (iv975.lo, iv975.hi) == (pytest.approx(0.052838, abs=1e-5), pytest.approx(0.547162, abs=1e-5))


def test_one_value_has_no_interval():
    iv = stats.interval([0.2], 0.975)
    assert (iv.n, iv.mean, iv.sd, iv.lo, iv.hi) == (1, 0.2, None, None, None)
    assert stats.classify(iv) is None


@pytest.mark.parametrize(
    ("d", "expected"),
    [
        # 0.1..0.5: 97.5% [0.0528, 0.5472] (test_interval_by_hand): above 0
        ([0.1, 0.2, 0.3, 0.4, 0.5], stats.RAISES),
        ([-0.1, -0.2, -0.3, -0.4, -0.5], stats.LOWERS),
        # -0.02..0.02 by 0.01: mean 0, sd 0.0158114, half 3.4954 x 0.0158114 / sqrt 5 = 0.024716: within +-0.10
        ([-0.02, -0.01, 0.0, 0.01, 0.02], stats.NO_DIFFERENCE),
        # ten times that: half 0.24716, the interval [-0.247, 0.247] holds 0 and reaches past +-0.10
        ([-0.2, -0.1, 0.0, 0.1, 0.2], stats.INCONCLUSIVE),
    ],
)
def test_rule_2_classes(d, expected):
    c = stats.compare("bandpo", "grpo", paired(d))
    assert c.look == ("first", 5) and c.verdict == expected


def test_decisions_use_the_97_5_interval():
    # d = 0, 0.03, .., 0.12: mean 0.06, sd 0.03 sqrt(2.5) = 0.0474342, se 0.0212132. 95%: half 2.7764 x
    # 0.0212132 = 0.058897 -> [0.00110, 0.11890], above 0; 97.5%: half 3.4954 x 0.0212132 = 0.074149 ->
    # [-0.01415, 0.13415]: inconclusive, and that is the verdict.
    c = stats.compare("bandpo", "grpo", paired([0.0, 0.03, 0.06, 0.09, 0.12]))
    assert c.shown.lo == pytest.approx(0.00110, abs=1e-5) and c.decision.lo == pytest.approx(
        -0.01415, abs=1e-5
    )
    assert stats.classify(c.shown) == stats.RAISES
    assert c.verdict == stats.INCONCLUSIVE


def test_a_split_pair_is_listed_and_left_out():
    grpo = ends("grpo", {0: 0.0, 1: 0.0, 2: 0.0})
    band = ends("bandpo", {0: 0.1, 1: 0.3}) + ends("bandpo", {2: 9.0}, machine=("Intel Xeon 8481C", True))
    c = stats.compare("bandpo", "grpo", grpo + band)
    assert c.d == {0: pytest.approx(0.1), 1: pytest.approx(0.3)}
    assert [s.seed for s in c.splits] == [2] and "Intel Xeon 8481C" in c.splits[0].reason
    # the same machine in another precision splits too
    c = stats.compare("bandpo", "grpo", grpo[:1] + ends("bandpo", {0: 0.1}, precision="bf16"))
    assert c.d == {} and c.splits[0].reason == "precision bf16 vs fp32"


def test_fewer_than_5_pairs_is_interim():
    # 4 pairs: numbers (0.1..0.4: mean 0.25), no class; 1 pair: no interval either
    c = stats.compare("bandpo", "grpo", paired([0.1, 0.2, 0.3, 0.4]))
    assert c.interim and c.look == ("interim", 5) and c.verdict is None
    assert c.decision.mean == pytest.approx(0.25) and c.decision.lo is not None
    one = stats.compare("bandpo", "grpo", paired([0.1]))
    assert one.interim and one.decision.lo is None and one.verdict is None
    assert stats.compare("bandpo", "grpo", []).decision is None
    # past 5, short of 8: the extension under way; at 8 the second look
    assert stats.look(6) == ("interim", 8) and stats.look(8) == ("second", 8)


def test_the_8_seed_rule():
    # inconclusive with sd 0.158 > 0.060: extend
    assert stats.extension(stats.compare("bandpo", "grpo", paired([-0.2, -0.1, 0.0, 0.1, 0.2]))) is True
    # inconclusive with sd 0.0474 <= 0.060 (test_decisions_use_the_97_5_interval): no extension
    assert stats.extension(stats.compare("bandpo", "grpo", paired([0.0, 0.03, 0.06, 0.09, 0.12]))) is False
    # decided (raises) with sd 0.158: no extension
    assert stats.extension(stats.compare("bandpo", "grpo", paired([0.1, 0.2, 0.3, 0.4, 0.5]))) is False
    # before seeds 0-4 are all paired: not yet applicable
    assert stats.extension(stats.compare("bandpo", "grpo", paired([-0.2, -0.1, 0.0, 0.1]))) is None
    # decided on seeds 0-4 alone, whatever seeds 5-7 add
    c = stats.compare("bandpo", "grpo", paired([-0.2, -0.1, 0.0, 0.1, 0.2, 5.0, 5.0]))
    assert c.look == ("interim", 8) and stats.extension(c) is True


def test_rule_1_sensitivity():
    # GRPO's D below no-clip's on every seed by 0.1..0.5: the interval excludes 0, visible
    no_clip = ends("no_clip", dict.fromkeys(range(5), 0.0))
    grpo = ends("grpo", dict(enumerate([-0.1, -0.2, -0.3, -0.4, -0.5])))
    assert stats.sensitivity(stats.compare("grpo", "no_clip", grpo + no_clip)) is True
    grpo = ends("grpo", dict(enumerate([-0.2, -0.1, 0.0, 0.1, 0.2])))
    assert stats.sensitivity(stats.compare("grpo", "no_clip", grpo + no_clip)) is False
    assert stats.sensitivity(stats.compare("grpo", "no_clip", grpo[:3] + no_clip)) is None
