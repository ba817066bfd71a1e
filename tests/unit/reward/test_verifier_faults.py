"""Verifier infrastructure faults are loud; response faults stay item grades.

Runs ``score_batch`` the ways users call it (a script on standard input, ``python -c``),
and pools whose workers cannot start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bandpo.reward import RewardScorer, VerifierUnavailable, check_error_share

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = """
from bandpo.reward import score_batch
print(sorted({s.status for s in score_batch(["Answer: 3"] * 20, ["3"] * 20, num_workers=2%s)}))
"""


def _python(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )


def test_score_batch_from_a_script_on_stdin():
    out = _python(["-"], stdin=SCRIPT % "")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['correct']"


def test_score_batch_from_python_c():
    out = _python(["-c", SCRIPT % ""])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['correct']"


# An entry script whose import fails in a worker: a module only the user's shell has, say.
UNGUARDED_SCRIPT = """
if __name__ != "__main__":
    raise ImportError("my_local_plugin is not importable here")
from bandpo.reward import RewardScorer
with RewardScorer(num_workers=1, start_method=%r) as scorer:
    print(scorer.score(["Answer: 3"], ["3"])[0].status)
"""


def test_workers_that_cannot_start_raise_verifier_unavailable(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(UNGUARDED_SCRIPT % "spawn")  # spawn: every worker imports the entry script
    out = _python([str(script)])
    assert out.returncode != 0
    assert (
        "VerifierUnavailable: reward pool: a worker process exited with code 1 before finishing its "
        "start-up" in out.stderr
    ), out.stderr
    assert "my_local_plugin is not importable here" in out.stderr  # the worker's own traceback
    assert "correct" not in out.stdout  # nothing was graded


def test_default_workers_do_not_import_the_entry_script(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(UNGUARDED_SCRIPT % None)
    out = _python([str(script)])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "correct"


# A model response that makes the real grader allocate: math-verify hands the parsed power to
# sympy, which evaluates 2^(2^29) to a 2^29-bit (64 MiB) integer and then makes copies of it
# while comparing it with the gold answer.


def test_error_share_above_the_limit_stops_naming_the_verifier():
    check_error_share(["error", "correct", "incorrect", "error"], 0.5, "step 3")  # 2 of 4: not more than half
    with pytest.raises(
        VerifierUnavailable,
        match=r"verifier \(math-verify reward pool\) failed on 3 of 4 "
        r"responses of step 3.*trainer.max_error_share=0.5",
    ):
        check_error_share(["error", "error", "error", "correct"], 0.5, "step 3")
    check_error_share([], 0.5)


def test_pool_workers_write_to_their_log_file(tmp_path):
    log = tmp_path / "logs" / "verifier.log"
    log.parent.mkdir()
    with RewardScorer(num_workers=1, log_path=log) as scorer:
        assert scorer.score(["Answer: 3"], ["3"])[0].status == "correct"
    assert log.exists()  # opened by every worker at start-up (stdout and stderr)
