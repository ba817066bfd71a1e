"""studies/claim/report.py: results.md and the figure from made-up records (numbers by hand)."""

from __future__ import annotations

import math

from studies.claim import report
from studies.claim.records import read_test


def test_report_end_to_end_on_three_runs(tmp_path, records, write_run):
    # H 2.0 -> 1.6 (GRPO, D = ln 0.8 = -0.223144), 2.0 -> 2.0 (no-clip, D = 0), 2.0 -> 1.0 (Band, D = ln 0.5 =
    # -0.693147): d = D_Band - D_GRPO = ln 0.625 = -0.470004, D_GRPO - D_no-clip = -0.223144; printed to 4
    # decimals, so the strings are exact.
    write_run(records, "grpo", 0, {0: 2.0, 10: 1.8, 20: 1.6}, {0: 0.25, 20: 0.3125})
    write_run(records, "no_clip", 0, {0: 2.0, 10: 2.0, 20: 2.0}, {0: 0.25, 20: 0.25})
    write_run(records, "bandpo", 0, {0: 2.0, 10: 1.5, 20: 1.0}, {0: 0.25, 20: 0.375})
    out = report.main(["--records", str(records), "--out", str(tmp_path / "results.md")])
    text = out.read_text()
    assert (
        text.splitlines()[2]
        == "**Test 1: interim: 1 of 5 seeds** (Band-KL and GRPO paired; the numbers below are shown, no verdict yet)."
    )
    assert "- d = D_bandpo - D_grpo per seed: s0 -0.4700." in text
    assert "- d = D_grpo - D_no_clip per seed: s0 -0.2231." in text
    assert "decision no interval (fewer than 2 pairs)" in text
    assert "- interim: 1 of 5 seeds, no class." in text
    assert "- Not yet applicable: seeds 0-4 of Band-KL and GRPO are not all paired." in text
    # eval mean@8 0.25 -> 25.0%, 0.375 -> 37.5%; wall 3000 s = 50.0 min
    # rollout entropy 0.5 + step / 100 (conftest): 0.51 at step 1, 0.70 at step 20
    row = (
        "| Band-KL | 0 | 2.0000 | 1.0000 | -0.6931 | 0.5100 | 0.7000 | 25.0 | 37.5 "
        "| AMD EPYC 7B13 (no hardware bf16) | fp32 | 50.0 |"
    )
    assert row in text
    assert (
        "| GRPO | 0 | 2.0000 | 1.6000 | -0.2231 | 0.5100 | 0.7000 | 25.0 | 31.2 |" in text
    )  # 31.25 rounds half to even
    assert "- AMD EPYC 7B13 (no hardware bf16), fp32: 3 runs" in text
    assert "- `records/random/bandpo-s0/`" in text
    assert "#### Clip-Higher against GRPO\n\n- d = D_clip_higher - D_grpo: no complete pair yet." in text
    png = tmp_path / report.FIGURE
    assert f"]({report.FIGURE})" in text and png.read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic writes left no temporary file


def test_no_runs_says_so(tmp_path):
    out = report.main(["--records", str(tmp_path / "none"), "--out", str(tmp_path / "results.md")])
    text = out.read_text()
    assert "**Test 1: no runs are recorded yet.**" in text and "No runs are recorded yet" in text
    assert not (tmp_path / report.FIGURE).exists()


def _five_seeds(records, write_run, d: list[float]) -> list:
    # GRPO and no-clip keep H = 2.0 (D = 0); Band ends at 2.0 exp(d_s), so D_Band - D_GRPO = d_s up to float
    # rounding (1e-15, far below the 4 decimals printed)
    for s, ds in enumerate(d):
        write_run(records, "grpo", s, {0: 2.0, 20: 2.0})
        write_run(records, "no_clip", s, {0: 2.0, 20: 2.0})
        write_run(records, "bandpo", s, {0: 2.0, 20: 2.0 * math.exp(ds)})
    return read_test(records / "random", 20)


def test_a_first_look_verdict_is_descriptive_when_rule_1_sees_nothing(tmp_path, records, write_run):
    # d = 0.1..0.5: 97.5% [0.0528, 0.5472] (test_stats.test_interval_by_hand): raises. GRPO - no-clip = 0 on
    # every seed: sd 0, the interval [0, 0] holds 0, so rule 1 makes the verdict descriptive.
    runs = _five_seeds(records, write_run, [0.1, 0.2, 0.3, 0.4, 0.5])
    text = report.report(runs, tmp_path / "results.md", figure_name=None)
    head = text.splitlines()[2]
    assert head.startswith(
        "**Test 1 (first look, 5 seeds, 97.5% intervals): Band raises entropy relative to GRPO.**"
    )
    assert "Descriptive only" in head and "8-seed" not in head
    assert "decision 97.5% [+0.0528, +0.5472]; shown 95% [+0.1037, +0.4963]" in text
    assert "every comparison below is descriptive" in text
    assert "- At 5 seeds: rule 2 raises, sample sd of d 0.1581 (threshold 0.060): no extension." in text


def test_an_inconclusive_first_look_calls_for_the_extension(tmp_path, records, write_run):
    # d = -0.2..0.2: mean 0, sd 0.158114 > 0.060, 97.5% [-0.2472, 0.2472]: inconclusive -> seeds 5-7
    runs = _five_seeds(records, write_run, [-0.2, -0.1, 0.0, 0.1, 0.2])
    head = report.report(runs, tmp_path / "results.md", figure_name=None).splitlines()[2]
    assert "Band against GRPO is inconclusive.**" in head
    assert head.endswith("The 8-seed rule calls for seeds 5, 6, 7 of grpo, bandpo, no_clip.")


def test_a_split_pair_is_listed_in_the_report(tmp_path, records, write_run):
    write_run(records, "grpo", 0, {0: 2.0, 20: 1.6})
    write_run(records, "bandpo", 0, {0: 2.0, 20: 1.0}, cpu="Intel Xeon 8481C", fast_bf16=True)
    text = report.report(read_test(records / "random", 20), tmp_path / "results.md", figure_name=None)
    assert "**Test 1: interim: 0 of 5 seeds**" in text
    assert (
        "- seed 0 left out, a split pair (machine ('Intel Xeon 8481C', True) vs ('AMD EPYC 7B13', False))"
        in text
    )
