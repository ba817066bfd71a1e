"""studies/entropy/stage1.py: the pilot's report (ratios to step 0, the rule's three
outcomes) from records alone, numbers by hand; --report rewrites only the Stage 1 section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from studies.entropy import stage1 as S1

REPO = Path(__file__).resolve().parents[3]


def _write(records: Path, entropies: dict[int, float]) -> None:
    records.mkdir(parents=True, exist_ok=True)
    for step, h in entropies.items():
        probe = {"entropy": h, "accuracy": 0.5, "truncated": 0.0}
        (records / f"probe-step_{step:06d}.json").write_text(json.dumps({"step": step, "probe": probe}))
    (records / "run").mkdir(exist_ok=True)
    rows = [{"step": 5, "reward/accuracy": 0.4375, "actor/entropy": 0.31}]
    (records / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_ratios_and_the_rule(tmp_path):
    # step 30 at 0.30 / 0.50 = 60%: the rule's bound itself goes on (<=)
    _write(tmp_path / "a", {0: 0.5, 5: 0.4, 10: 0.35, 30: 0.3})
    text = S1.report(tmp_path / "a")
    assert text.startswith("## Stage 1: a GRPO pilot") and text.index("Rule:") < text.index("| step |")
    assert "| 0 | 0.5000 | 1.000 | 0.500 | 0.000 |  |  |" in text
    assert "| 5 | 0.4000 | 0.800 | 0.500 | 0.000 | 0.438 | 0.3100 |" in text  # the run's step-5 metrics
    assert "fell to 60% of its start by step 30: stage 2 runs" in text
    _write(tmp_path / "b", {0: 0.5, 5: 0.32, 30: 0.4})  # lowest 64% at step 5: above the rule
    assert "stayed above 60% of its start through step 30 (lowest 64%, step 5)" in S1.report(tmp_path / "b")
    _write(tmp_path / "c", {0: 0.5, 5: 0.4})  # 80% and the run not at step 30 yet
    assert "Not decided: probes up to step 5 of 30." in S1.report(tmp_path / "c")
    _write(tmp_path / "d", {0: 0.5, 5: 0.25})  # 50% at step 5 decides before the run ends
    assert "fell to 50% of its start by step 5: stage 2 runs" in S1.report(tmp_path / "d")


def test_report_command_rewrites_only_stage_1(tmp_path):
    _write(tmp_path / "records", {0: 0.5, 30: 0.2})
    out = tmp_path / "results-entropy.md"
    out.write_text(
        "# title\n\n## Stage 0: paired\nkeep 0\n\n## Stage 1: old\nold\n\n## Stage 2: later\nkeep 2\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "studies.entropy.stage1",
        "--report",
        "--records",
        str(tmp_path / "records"),
    ]
    subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, check=True, capture_output=True, text=True, timeout=120
    )
    text = out.read_text()
    assert text.startswith("# title\n\n## Stage 0: paired\nkeep 0\n\n## Stage 1: a GRPO pilot")
    assert text.endswith("\n\n## Stage 2: later\nkeep 2\n") and "old\n" not in text
    assert "fell to 40% of its start by step 30" in text
