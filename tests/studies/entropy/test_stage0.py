"""studies/entropy/stats.py: stage 0's paired interval, verdicts and report, numbers by
hand; ``python -m studies.entropy.stage0 --report`` rebuilds the report from records alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from studies.entropy import stats as S

REPO = Path(__file__).resolve().parents[3]
STUDY = REPO / "studies" / "entropy"


def test_t_quantile_against_closed_forms_and_tables():
    # df 1: the Cauchy, P(|T| < t) = 2 atan(t) / pi, so t = tan(0.95 pi / 2); df 2: P = t / sqrt(t^2 + 2),
    # so t^2 = 2 P^2 / (1 - P^2). Bisection stops at 1e-12 relative: 1e-9 is loose.
    assert S.t_quantile(0.95, 1) == pytest.approx(math.tan(0.95 * math.pi / 2), abs=1e-9)  # 12.7062
    assert S.t_quantile(0.95, 2) == pytest.approx(math.sqrt(2 * 0.95**2 / (1 - 0.95**2)), abs=1e-9)  # 4.3027
    # Printed tables (4 decimals, so half a unit of the 4th): df 5, 17 (stage 0's 6 and 18 trials), 30.
    assert S.t_quantile(0.95, 5) == pytest.approx(2.5706, abs=5e-5)
    assert S.t_quantile(0.95, 17) == pytest.approx(2.1098, abs=5e-5)
    assert S.t_quantile(0.95, 30) == pytest.approx(2.0423, abs=5e-5)


def test_t_two_sided_odd_series_by_hand():
    # df 3 at t = 3: theta = atan(3 / sqrt(3)) = pi/3, P = (2/pi)(pi/3 + sin cos) = 2/3 + (2/pi)(sqrt(3)/4) = 0.942331
    assert S.t_two_sided(3.0, 3) == pytest.approx(2 / 3 + math.sqrt(3) / (2 * math.pi), abs=1e-12)
    # df 4 at t = 2: theta = atan(1) = pi/4, P = sin (1 + cos^2 / 2) = (sqrt(2)/2)(1.25) = 0.883883
    assert S.t_two_sided(2.0, 4) == pytest.approx(math.sqrt(2) / 2 * 1.25, abs=1e-12)
    with pytest.raises(ValueError, match="positive integer"):
        S.t_two_sided(1.0, 0)


def test_mean_interval_by_hand():
    # mean 0.02, sd 0.01 (deviations -0.01, 0.01, 0: sum of squares 2e-4 / 2), half-width
    # t(0.95, 2) x 0.01 / sqrt(3) = 4.302653 x 0.0057735 = 0.0248414
    iv = S.mean_interval([0.01, 0.03, 0.02])
    half = math.sqrt(2 * 0.95**2 / (1 - 0.95**2)) * 0.01 / math.sqrt(3)
    assert (iv.n, iv.mean, iv.sd) == (3, pytest.approx(0.02, abs=1e-15), pytest.approx(0.01, abs=1e-15))
    assert iv.lo == pytest.approx(0.02 - half, abs=1e-12) and iv.hi == pytest.approx(0.02 + half, abs=1e-12)
    assert round(iv.lo, 7) == -0.0048414 and round(iv.hi, 7) == 0.0448414
    one = S.mean_interval([0.5])
    assert (one.mean, one.sd, one.lo, one.hi) == (0.5, None, None, None)
    with pytest.raises(ValueError, match="no values"):
        S.mean_interval([])


def test_log_changes_and_threshold_by_hand():
    # H before 0.5, GRPO after 0.45, BandPO after 0.49: ln 0.9 = -0.1053605, ln 0.98 = -0.0202027,
    # d = ln(0.49 / 0.45) = 0.0851578
    dg, db, d = S.log_changes(0.5, 0.45, 0.49)
    assert dg == pytest.approx(-0.1053605157, abs=1e-10) and db == pytest.approx(-0.0202027073, abs=1e-10)
    assert d == pytest.approx(0.0851578084, abs=1e-10)
    assert S.THRESHOLD == pytest.approx(0.6931471806 / 60, abs=1e-12)  # ln 2 / 60 = 0.0115525
    with pytest.raises(ValueError, match="bandpo must be a positive"):
        S.log_changes(0.5, 0.45, 0.0)


def test_verdicts():
    t = S.THRESHOLD
    assert S.verdict(S.Interval(6, 0.005, 0.004, 0.001, 0.0114)) == "below"  # upper end under 0.01155
    assert S.verdict(S.Interval(6, 0.02, 0.004, 0.0116, 0.03)) == "above"
    assert S.verdict(S.Interval(6, 0.01, 0.004, 0.0, t)) == "includes"  # the threshold itself is inside
    assert S.verdict(S.Interval(1, 0.01, None, None, None)) == "n/a"
    assert "not run" in S.overall_verdict({"a": "below", "b": "below", "all": "includes"})
    assert "does not rule" in S.overall_verdict({"a": "below", "b": "includes", "all": "below"})
    assert "at b the interval lies above" in S.overall_verdict({"a": "below", "b": "above"}).lower()
    assert "fewer than 2" in S.overall_verdict({"a": "n/a"})


def _record(state: str, order: int, batch: int, d: float, h0: float = 1.0) -> dict:
    """A trial whose GRPO update lost 3% of log-entropy and BandPO d more."""
    hg = h0 * math.exp(-0.03)
    return {
        "state": state,
        "state_order": order,
        "batch": batch,
        "settings": {"batch": "8 prompts x 8", "update": "4 steps", "probe": "32 x 4"},
        "probe": {"entropy_before": h0},
        "batch_stats": {"accuracy": 0.25},
        "arms": {
            "grpo": {
                "entropy": hg,
                "entropy_fixed": hg,
                "update": {"clip_frac_up": 0.0012, "clip_frac_down": 0.05},
            },
            "bandpo": {"entropy": hg * math.exp(d), "entropy_fixed": hg * math.exp(d / 2)},
        },
        "wall_s": 600.0,
    }


def _records() -> list[dict]:
    # state s0: d = 0.01, 0.03, 0.02 -> mean 0.02, interval [-0.0048, 0.0448] (test_mean_interval_by_hand)
    # state s1: d = 0.001, 0.002, 0.003 -> mean 0.002, sd 0.001, half 0.00248: [-0.0005, 0.0045], below
    return [_record("s0", 0, b, d) for b, d in enumerate((0.01, 0.03, 0.02))] + [
        _record("s1", 1, b, d, h0=0.5) for b, d in enumerate((0.001, 0.002, 0.003))
    ]


def test_summarise_per_state_and_all():
    summary = S.summarise(_records())
    assert list(summary) == ["s0", "s1", "all"]
    assert summary["s0"]["dg"].mean == pytest.approx(-0.03, abs=1e-12)
    assert summary["s0"]["db"].mean == pytest.approx(-0.01, abs=1e-12)
    assert summary["s1"]["d"].mean == pytest.approx(0.002, abs=1e-12)
    assert summary["s1"]["d"].hi == pytest.approx(0.002 + 4.302653 * 0.001 / math.sqrt(3), abs=1e-6)
    assert summary["all"]["d"].n == 6 and summary["all"]["d"].mean == pytest.approx(0.011, abs=1e-12)
    fixed = S.summarise(_records(), "fixed")  # the records' fixed-response entropies moved d / 2
    assert fixed["s0"]["d"].mean == pytest.approx(0.01, abs=1e-12)
    with pytest.raises(ValueError, match="lacks"):
        S.summarise([{"state": "x", "batch": 0, "probe": {}}])


def test_report_rules_first_then_tables_and_verdict():
    text = S.report(_records())
    assert text.index("Verdict rules") < text.index("| state |")
    assert "| s0 | 3 | -3.00% | -1.00% | **+2.00%** | [-0.48%, +4.48%] | +1.16% | includes |" in text
    assert "| s1 | 3 | -3.00% | -2.80% | **+0.20%** | [-0.05%, +0.45%] | +1.16% | below |" in text
    assert "does not rule a 2x ratio out" in text  # s0 includes the threshold
    assert text.count("| s0 | 0 | 0.250 | 1.0000 |") == 1  # one line per trial
    assert (
        "| +1.00% | 0.12% / 5.00% | - | 10.0 |" in text
    )  # s0 batch 0: d, GRPO's clips, none recorded for BandPO


def test_replace_section_keeps_the_other_stages():
    doc = "# T\n\nintro\n\n## Stage 0: old\nold text\n\n## Stage 1: pilot\nkeep\n"
    out = S.replace_section(doc, "## Stage 0: new\nnew text\n")
    assert out == "# T\n\nintro\n\n## Stage 0: new\nnew text\n\n## Stage 1: pilot\nkeep\n"
    assert S.replace_section("# T\n", "## Stage 0\nx\n") == "# T\n\n## Stage 0\nx\n"
    assert (
        S.replace_section("# T\n\n## Stage 1\ny\n", "## Stage 0\nx\n")
        == "# T\n\n## Stage 0\nx\n\n## Stage 1\ny\n"
    )


def test_report_command_rebuilds_from_records(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    for r in _records():
        (records / f"{r['state']}-b{r['batch']}.json").write_text(json.dumps(r))
    out = tmp_path / "results-entropy.md"
    out.write_text("# kept title\n\n## Stage 1: pilot\nkeep\n")
    cmd = [sys.executable, "-m", "studies.entropy.stage0", "--report", "--records", str(records)]
    subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, check=True, capture_output=True, text=True, timeout=120
    )
    text = out.read_text()
    assert text.startswith("# kept title\n\n## Stage 0:") and text.endswith("\n\n## Stage 1: pilot\nkeep\n")
    assert "| all | 6 |" in text


def test_the_script_stops_when_the_recorded_grpo_run_is_gone(tmp_path):
    # Trials were recorded from the run's states; training it again would give another run's states.
    records = tmp_path / "records"
    (records / "grpo-run").mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "RUNS": str(tmp_path / "runs"), "RECORDS": str(records)}
    script = STUDY / "stage0.sh"
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"{tmp_path / 'runs'}/grpo is gone" in done.stderr
    assert not (tmp_path / "runs").exists()  # nothing trained
