"""studies/compare/compare.sh's RECORD: finished runs' numbers are kept and, on a machine without the
runs, restored and skipped. The trainer is a stand-in script that writes what the real one does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# Writes config.yaml at the start and metrics.jsonl with a step-0 and a final evaluation, as bandpo.train
# does; exits 1 when FAKE_FAIL is set, so a run it is asked for shows as FAILED.
FAKE_TRAIN = """
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
if os.environ.get("FAKE_FAIL"):
    sys.exit(1)
out, steps = args["trainer.output_dir"], int(args["trainer.total_steps"])
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "config.yaml"), "w").write("trainer:\\n  total_steps: %d\\n" % steps)
key = "eval/tiny_arith_test/mean@32"
rows = [{"step": 0, key: 0.5}, {"step": 1, "time/step": 2.0, "actor/entropy": 0.3},
        {"step": steps, "final": True, key: 0.6}]
open(os.path.join(out, "metrics.jsonl"), "w").write("".join(json.dumps(r) + "\\n" for r in rows))
"""


def _compare(tmp_path: Path, fail: bool) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        ALGOS="grpo bandpo",
        SEEDS="0",
        STEPS="1",
        RUNS=str(tmp_path / "runs"),
        RESULTS=str(tmp_path / "results.md"),
        RECORD=str(tmp_path / "record"),
        TRAIN=f"{sys.executable} {tmp_path / 'fake_train.py'}",
        TZ="UTC",
    )
    if fail:
        env["FAKE_FAIL"] = "1"
    script = REPO / "studies" / "compare" / "compare.sh"
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)


def test_record_keeps_finished_runs_and_a_new_machine_skips_them(tmp_path):
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    first = _compare(tmp_path, fail=False)
    assert first.returncode == 0, first.stdout + first.stderr
    for run in ("grpo-s0", "bandpo-s0"):
        kept = tmp_path / "record" / run
        assert sorted(p.name for p in kept.iterdir()) == ["config.yaml", "metrics.jsonl", "times"]
        assert (
            kept.joinpath("metrics.jsonl").read_text()
            == (tmp_path / "runs" / run / "metrics.jsonl").read_text()
        )
        start, end = map(int, kept.joinpath("times").read_text().split())
        assert start == int((tmp_path / "runs" / run / "config.yaml").stat().st_mtime) <= end
    # A new machine: no runs folder. A run asked for would fail, so passing means none was started.
    (tmp_path / "record" / "grpo-s0" / "times").write_text("1795820400 1795821154\n")
    shutil.rmtree(tmp_path / "runs")
    second = _compare(tmp_path, fail=True)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("restored from") == 2 and second.stdout.count("skipped") == 2
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "grpo-s0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1] == {"step": 1, "final": True, "eval/tiny_arith_test/mean@32": 0.6}
    # the report takes the recorded times, not the copies' file times: | steps | before → after | ... | wall |
    report = (tmp_path / "results.md").read_text()
    assert "| 1/1 | 50.0 → 60.0 | 0.300 | 2 | 754 |" in report
    assert "- runs: 2026-11-27 23:00 UTC to " in report  # grpo-s0's recorded start, the earliest
