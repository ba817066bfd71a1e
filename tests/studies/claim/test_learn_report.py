"""studies/claim/learn_report.py through report.main: Test 2's section of results.md from made-up records."""

from __future__ import annotations

import math

from studies.claim import learn_report, report

HELDOUT = "/somewhere/tiny_arith_l2_one_op_test.jsonl"  # a file in eval.datasets: the set is its stem


def _learn_run(records, write_run, arm, seed, h_last, probe_end, ev_end):
    # rollout entropy 0.5 over steps 1-5 and 1-30, h_last over 31-40 (first-n the same); accuracy 0.3 at
    # every step; 70% of groups without signal; probe 0.5 at step 0 and probe_end at step 40
    steps = range(1, 41)
    rollout = {s: 0.5 if s <= 30 else h_last for s in steps}
    series = {
        "actor/entropy": rollout,
        "entropy/ended_first_n": rollout,
        "reward/accuracy": {s: 0.3 for s in steps},
        "adv/zero_signal_group_frac": {s: 0.7 for s in steps},
    }
    write_run(
        records, arm, seed, {0: 0.5, 20: 0.5, 40: probe_end}, {0: 0.25, 40: ev_end},
        steps=40, test="learn", series=series, eval_set=HELDOUT,
    )  # fmt: skip


def test_test_2_section_end_to_end(tmp_path, records, write_run):
    # GRPO keeps 0.35 / 0.5 = 0.70 of its rollout entropy (gate: <= 0.8 passes); accuracy 30% and 30% of
    # groups with advantage pass. Band-KL 0.7 over GRPO's 0.35: r = ln 2 = 0.6931; probe 0.6 / 0.4:
    # f = ln 1.5 = 0.4055; held-out 0.3125 - 0.25 = +6.25 points, printed +6.2500
    _learn_run(records, write_run, "grpo", 0, 0.35, 0.4, 0.25)
    _learn_run(records, write_run, "bandpo", 0, 0.7, 0.6, 0.3125)
    text = report.main(["--records", str(records), "--out", str(tmp_path / "results.md")]).read_text()
    lines = text.splitlines()
    assert lines[2] == "**Test 1: no runs are recorded yet.**"
    assert lines[4] == (
        "**Test 2: interim: 1 of 5 seeds** (Band-KL and GRPO paired; the numbers below are shown, no verdict yet)."
    )
    assert "- training accuracy, steps 1-3: 0.300 (must be within 20%-45%): passes." in text
    assert "- groups with advantage, steps 36-40: 0.300 (must be >= 25%): passes." in text
    assert "- rollout entropy, steps 31-40 over steps 1-5: 0.700 (must be <= 0.8): passes." in text
    assert "- The pilot passes: it is seed 0's GRPO arm." in text
    assert f"s0 {math.log(2):+.4f}; mean {math.log(2):+.4f}, decision no interval" in text
    assert f"(co-primary): s0 {math.log(1.5):+.4f};" in text
    assert "(non-inferior above -5): s0 +6.2500;" in text
    assert "- interim: 1 of 5 seeds, no verdict." in text
    assert "| Band-KL | 0 | 30.0 | 0.5000 | 0.7000 | 0.7000 | 0.5000 | 0.6000 | 25.0 | 31.2 |" in text
    assert "- `records/learn/bandpo-s0/`" in text
    png = tmp_path / learn_report.FIGURE
    assert f"]({learn_report.FIGURE})" in text and png.read_bytes()[:4] == b"\x89PNG"


def test_a_failing_pilot_says_it_is_never_used(tmp_path, records, write_run):
    _learn_run(records, write_run, "grpo", 0, 0.45, 0.4, 0.25)  # keeps 0.9 of its entropy
    text = report.main(["--records", str(records), "--out", str(tmp_path / "results.md")]).read_text()
    assert "0.900 (must be <= 0.8): FAILS." in text
    assert "- The pilot fails the gate: it is reported and never used" in text
    assert "- No complete pair yet." in text


def test_failed_pilots_are_listed_with_why_they_stopped(tmp_path, records, write_run):
    folder = records / "learn-pilots" / "l2-one-op" / "grpo-s0"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text('{"pool": "l2-one-op", "stopped_because": "accuracy 0.104 < 0.20"}')
    text = report.main(["--records", str(records), "--out", str(tmp_path / "results.md")]).read_text()
    assert "### Failed pilots (reported, never used)" in text
    assert "- `records/learn-pilots/l2-one-op/grpo-s0/` (pool l2-one-op): accuracy 0.104 < 0.20." in text
    assert "No runs are recorded yet (`records/learn/" in text
