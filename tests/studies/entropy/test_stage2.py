"""studies/entropy/stage2.py and verdict.py: the verdict rules, the ratio and
accuracy intervals (numbers by hand), stage 1's gate, the runs' commands, and the report from records
alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from studies.entropy import stage2 as S2
from studies.entropy import verdict as V

REPO = Path(__file__).resolve().parents[3]


def test_ratio_interval_by_hand():
    # ln R = 0.095310, 0.182322, 0: mean 0.092544, sd 0.091194; t(0.95, 2) = 4.302653
    # half-width 4.302653 x 0.091194 / sqrt(3) = 0.226535
    mean, lo, hi = V.ratio_interval([1.1, 1.2, 1.0])
    assert mean == pytest.approx(math.exp(0.092544), abs=1e-5)  # 1.096961
    assert lo == pytest.approx(math.exp(0.092544 - 0.226535), abs=1e-5)  # 0.874600
    assert hi == pytest.approx(math.exp(0.092544 + 0.226535), abs=1e-5)  # 1.375863
    with pytest.raises(ValueError, match="2 seeds"):
        V.ratio_interval([2.0])


def test_noninferiority_by_hand():
    # d = -2, 2, -5: mean -1.666667, sd 3.511885; one-sided 95% = two-sided 90%: t(0.90, 2) = 2.919986
    # lower end -1.666667 - 2.919986 x 3.511885 / sqrt(3) = -1.666667 - 5.920524 = -7.587191
    diff, low, ok = V.noninferiority([50.0, 60.0, 55.0], [52.0, 58.0, 60.0])
    assert diff == pytest.approx(-5 / 3, abs=1e-9)
    assert low == pytest.approx(-7.587191, abs=1e-5)
    assert ok  # above -10
    assert not V.noninferiority([50.0, 60.0, 55.0], [52.0, 58.0, 60.0], margin=7.5)[2]


@pytest.mark.parametrize(
    "grpo60, band60, expected",
    [
        ([0.4, 0.5, 0.3], [0.9, 1.0, 0.7], "holds"),  # G <= 0.5 (0.5 itself counts), R 2.25 / 2.0 / 2.33
        ([0.4, 0.4, 0.4], [0.44, 0.48, 0.40], "fails"),  # R 1.1 / 1.2 / 1.0: interval's upper end 1.376 < 1.5
        ([0.6, 0.4, 0.4], [1.5, 1.0, 1.0], "inconclusive"),  # seed 0 did not collapse (G 0.6)
        ([0.4, 0.4, 0.4], [0.76, 1.0, 0.88], "inconclusive"),  # R 1.9 / 2.5 / 2.2: not all >= 2, upper > 1.5
    ],
)
def test_verdict_rules(grpo60, band60, expected):
    assert V.verdict([1.0, 1.0, 1.0], grpo60, band60) == expected


def _probe(path: Path, step: int, h: float, tokens: int = 6400, truncated: float = 0.0625) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = {"entropy": h, "tokens": tokens, "truncated": truncated, "accuracy": 0.5}
    path.write_text(json.dumps({"step": step, "source": "x", "settings": {}, "probe": probe}))


def test_stage1_gate(tmp_path):
    for step, h in {0: 0.5, 5: 0.45, 10: 0.4}.items():
        _probe(tmp_path / f"probe-step_{step:06d}.json", step, h)
    ok, why = S2.stage1_lets_run(tmp_path)
    assert not ok and "not complete" in why  # no probe at step 30 yet
    _probe(tmp_path / "probe-step_000030.json", 30, 0.35)  # 70%
    ok, why = S2.stage1_lets_run(tmp_path)
    assert not ok and "70%" in why
    _probe(tmp_path / "probe-step_000025.json", 25, 0.3)  # 60%: the rule's bound itself lets it run
    ok, why = S2.stage1_lets_run(tmp_path)
    assert ok and "60%" in why


def test_runs_are_paired_by_seed_and_continue_stage_1():
    assert S2.plan() == [("grpo", 0), ("bandpo", 0), ("grpo", 1), ("bandpo", 1), ("grpo", 2), ("bandpo", 2)]
    cmd = S2.train_command("bandpo", 2, Path("/r/bandpo-s2"), ["actor.bf16=false"])
    assert cmd[:2] == ["bash", "scripts/train.sh"]
    assert cmd[2 : 2 + len(S2.SETTING)] == list(S2.SETTING)  # stage 1's settings, first
    for item in ("algorithm=bandpo", "algorithm.band.divergence=kl", "algorithm.band.delta=0.05"):
        assert item in cmd
    for item in ("trainer.seed=2", "trainer.total_steps=60", "trainer.save_every=5", "trainer.keep_last=12"):
        assert item in cmd  # every probed checkpoint kept until its probe
    assert "trainer.output_dir=/r/bandpo-s2" in cmd and cmd[-1] == "actor.bf16=false"


def _records(folder: Path, h0: float, h60: dict[str, float], acc: dict[str, float], seeds=(0, 1, 2)) -> None:
    _probe(folder / "probe-base-step_000000.json", 0, h0)
    for seed in seeds:
        for arm in ("grpo", "bandpo"):
            name = f"{arm}-s{seed}"
            for step in range(5, 61, 5):
                _probe(folder / f"probe-{name}-step_{step:06d}.json", step, h60[arm] if step == 60 else h0)
            results = {"tiny_arith_test": {"mean@8": acc[arm], "maj@8": 0.5, "pass@8": 0.9, "truncated": 0.0}}
            (folder / f"eval-{name}-step_000060-sampled.json").write_text(json.dumps({"results": results}))


def test_report_from_records(tmp_path):
    assert "Not run yet." in V.report(tmp_path)
    _records(tmp_path, 0.5, {"grpo": 0.2, "bandpo": 0.5}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0, 1))
    text = V.report(tmp_path)
    assert "Not complete: 2 of 3 seeds" in text and "Not decided yet." in text and "**Verdict" not in text
    assert "R = H_BandPO(60) / H_GRPO(60) so far: seed 0 2.50, seed 1 2.50." in text
    _records(tmp_path, 0.5, {"grpo": 0.2, "bandpo": 0.5}, {"grpo": 0.40, "bandpo": 0.45})
    text = V.report(tmp_path)
    # G = 0.2 / 0.5 = 0.4 and R = 2.5 on every seed; no spread: the interval is the point itself
    assert "G = H_GRPO(60) / H(0) 0.40, 0.40, 0.40" in text and "R's geometric mean 2.50" in text
    assert "+5.0 points" in text and "non-inferior" in text
    assert "**Verdict: the claim holds at this scale.**" in text
    assert "| grpo-s0 | 60 | 40.0 / 50.0 / 90.0 / 0.0 / - | - / - / - / - / - |" in text
    greedy = {"tiny_arith_test": {"mean@1": 0.5}, "l1_test": {"mean@1": 0.75}}
    (tmp_path / "eval-grpo-s0-step_000060-greedy.json").write_text(json.dumps({"results": greedy}))
    assert "| grpo-s0 | 60 | 40.0 / 50.0 / 90.0 / 0.0 / 50.0 | - / - / - / - / 75.0 |" in V.report(tmp_path)


def test_probe_responses_beside_the_entropy(tmp_path):
    _records(tmp_path, 0.5, {"grpo": 0.2, "bandpo": 0.5}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0,))
    _probe(tmp_path / "probe-bandpo-s0-step_000060.json", 60, 0.5, tokens=16384, truncated=1.0)
    lines = V.probe_table(V.collect(tmp_path)["probes"])
    # 12 probed steps and step 0: 13 cells a row; runs without a record have no row
    assert lines[2] == "| run | 0 | " + " | ".join(str(s) for s in range(5, 61, 5)) + " |"
    assert lines[4] == "| base | 6400 / 6 / 50 |" + "  |" * 12
    assert lines[6].startswith("| bandpo-s0 |  | 6400 / 6 / 50 |")
    assert lines[6].endswith("| 16384 / 100 / 50 |") and len(lines) == 7


def test_a_replicate_is_shown_after_the_plans_runs_and_not_judged(tmp_path):
    _records(tmp_path, 0.5, {"grpo": 0.3, "bandpo": 0.45}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0,))
    before = V.report(tmp_path)
    _probe(tmp_path / "probe-bandpo-s0-replicate-step_000030.json", 30, 0.4, truncated=0.5)
    results = {"tiny_arith_test": {"mean@8": 0.25, "maj@8": 0.5, "pass@8": 0.75, "truncated": 0.5}}
    (tmp_path / "eval-bandpo-s0-replicate-step_000030-sampled.json").write_text(
        json.dumps({"results": results})
    )
    (tmp_path / "run-bandpo-s0-replicate").mkdir()
    rows = [{"step": s, "reward/accuracy": 0.5, "actor/entropy": 0.25} for s in (1, 2)]
    (tmp_path / "run-bandpo-s0-replicate" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    assert V.run_names(tmp_path) == [f"{a}-s{s}" for s in (0, 1, 2) for a in ("grpo", "bandpo")] + [
        "bandpo-s0-replicate"
    ]
    text = V.report(tmp_path)
    # step 30 is the 6th probed step: 5 empty cells before it, 6 after; H / H(0) = 0.4 / 0.5
    assert "| bandpo-s0-replicate |" + "  |" * 5 + " 0.400 (0.80) |" + "  |" * 6 in text
    assert "| bandpo-s0-replicate | 30 | 25.0 / 50.0 / 75.0 / 50.0 / - | - / - / - / - / - |" in text
    assert "| bandpo-s0-replicate | 1-2 | 0.500 |  |  |  |  | 0.250 |" in text
    verdict = before[before.index("Not complete") :]
    assert text.endswith(verdict)  # the same verdict lines: the replicate is not a seed


def test_one_grpo_seed_short_of_collapse_fixes_the_verdict(tmp_path):
    # seed 0 alone: GRPO 0.3 / 0.5 = 0.60 > 0.5 of its start; holds and fails both need <= 0.5 on every seed
    _records(tmp_path, 0.5, {"grpo": 0.3, "bandpo": 0.45}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0,))
    text = V.report(tmp_path)
    assert "Not complete: 1 of 3 seeds" in text and "seed 0 1.50." in text
    assert "G = 0.60 of its probe entropy at step 60 on seed 0" in text
    assert "**Verdict: inconclusive at this scale.**" in text
    # exactly at the bound (0.25 / 0.5 = 0.5): collapsed by the rules, so nothing is fixed yet
    _records(tmp_path, 0.5, {"grpo": 0.25, "bandpo": 0.45}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0,))
    assert "Not decided yet." in V.report(tmp_path) and "**Verdict" not in V.report(tmp_path)


def test_a_fixed_verdict_holds_back_seeds_not_begun(tmp_path):
    records, runs = tmp_path / "records", tmp_path / "runs"
    _records(records, 0.5, {"grpo": 0.25, "bandpo": 0.45}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0,))
    assert S2.held_back(records, runs, 1) is None  # G = 0.5: collapsed by the rules, nothing fixed
    _records(records, 0.5, {"grpo": 0.3, "bandpo": 0.45}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0,))
    (records / "run-grpo-s0").mkdir()
    assert S2.held_back(records, runs, 0) is None  # seed 0 begun: its BandPO partner still runs
    assert "GRPO seed 0 kept 0.60" in S2.held_back(records, runs, 1)
    (runs / "grpo-s1").mkdir(parents=True)  # a sitting that began seed 1 before the verdict was fixed
    assert S2.held_back(records, runs, 1) is None and "seed 2 and later" in S2.held_back(records, runs, 2)


def test_a_run_with_records_and_no_folder_is_not_trained_again(tmp_path):
    records, folder = tmp_path / "records", tmp_path / "runs" / "bandpo-s0"
    records.mkdir()
    assert S2.lost("bandpo-s0", folder, records) is None  # nothing recorded: a first run
    (records / "probe-bandpo-s0-step_000005.json").write_text("{}")
    (records / "probe-bandpo-s0-replicate-step_000030.json").write_text("{}")  # another run's record
    (records / "run-bandpo-s0").mkdir()
    why = S2.lost("bandpo-s0", folder, records)
    assert "is gone" in why and "probe-bandpo-s0-step_000005.json, run-bandpo-s0/)" in why
    assert S2.lost("grpo-s0", tmp_path / "runs" / "grpo-s0", records) is None  # only its own records count
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("")
    assert S2.lost("bandpo-s0", folder, records) is None  # the folder is there: it resumes


def test_a_checkpoint_is_the_same_source_however_written():
    rel = "runs/entropy_stage1/grpo/checkpoints/step_000005"
    assert S2.same_source(rel, str(REPO / rel)) and S2.same_source("base", "base")
    assert not S2.same_source("base", rel) and not S2.same_source(rel, rel.replace("05", "10"))


def test_headline_figure_from_records(tmp_path):
    from studies.entropy import figure as fig  # matplotlib: only this test

    _records(tmp_path, 0.5, {"grpo": 0.2, "bandpo": 0.5}, {"grpo": 0.40, "bandpo": 0.45}, seeds=(0,))
    base = {"tiny_arith_test": {"mean@8": 0.25}}
    (tmp_path / "eval-base-step_000000-sampled.json").write_text(json.dumps({"results": base}))
    rows = [{"step": 1, "actor/entropy": 0.54, "actor/clip_frac_up": 0.002, "actor/clip_frac_down": 0.0125},
            {"note": "no step: skipped"}, {"step": 2, "actor/entropy": 0.5}]  # fmt: skip
    (tmp_path / "run-grpo-s0").mkdir()
    (tmp_path / "run-grpo-s0" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    runs = fig.series(tmp_path)
    assert list(runs) == ["grpo-s0", "bandpo-s0"]  # seeds 1 and 2 have no record: left out
    grpo = runs["grpo-s0"]
    # H / H(0): 1.0 at the base, 0.5 / 0.5 = 1.0 to step 55, 0.2 / 0.5 = 0.4 at 60
    assert grpo["probe"][0] == (0, 1.0) and grpo["probe"][-1] == pytest.approx((60, 0.4))
    assert len(grpo["probe"]) == 13
    assert grpo["rollout"] == [(1, 0.54), (2, 0.5)]
    assert grpo["up"] == [(1, pytest.approx(0.2))] and grpo["down"] == [(1, pytest.approx(1.25))]
    assert grpo["mean@8"] == [(0, 25.0), (60, 40.0)]  # no step-30 record: no point
    assert runs["bandpo-s0"]["rollout"] == [] and runs["bandpo-s0"]["mean@8"] == [(0, 25.0), (60, 45.0)]
    # the training signal's means over steps 1-2: entropy (0.54 + 0.5) / 2; the clip shares from step 1 alone
    assert "| grpo-s0 | 1-2 |  |  | 0.200 | 1.250 |  | 0.520 |" in V.signal_table(tmp_path)
    png = fig.draw(runs, tmp_path / "headline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![headline](h.png)" in V.report(tmp_path, "h.png")
