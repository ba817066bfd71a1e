"""Verifier infrastructure faults are loud; response faults stay item grades (issue 16).

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

ROOT = Path(__file__).resolve().parent.parent
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


EXPAND_UNDER_CAP = """
from bandpo.reward.startup import init_worker
init_worker(256 << 20)  # what each pool worker does first, with a 256 MiB cap
import sympy
x, y, z = sympy.symbols("x y z")
try:
    sympy.expand((x + y + z + 1) ** 300)  # ~4.5M terms: gigabytes of sympy objects
    print("computed")
finally:
    print("stopped", flush=True)
"""


def test_worker_memory_cap_turns_a_sympy_blowup_into_memory_error():
    # Uncapped this expansion grows by ~100 MB/s up to several GB; under 256 MiB it stops
    # within seconds (2.3 s measured here).
    # The MemoryError may recur while unwinding (the pool then counts a crashed worker: the
    # item ends ``error``); either way the process stopped at the cap instead of growing.
    out = _python(["-c", EXPAND_UNDER_CAP])
    assert "computed" not in out.stdout and "MemoryError" in out.stderr, (out.stdout, out.stderr[-2000:])


def test_grading_works_under_a_tight_memory_cap():
    # 256 MiB: 3-4x what a worker maps; crafted answers then fail alone, as items.
    with RewardScorer(num_workers=1, memory_cap_gib=0.25, timeout=10) as scorer:
        scores = scorer.score(
            ["Answer: 3", "Answer: $\\frac{1}{2}$", "Answer: $(x+y+z+1)^{300}$"], ["3", "0.5", "4"]
        )
    assert [s.status for s in scores[:2]] == ["correct", "correct"]
    assert scores[2].status in ("error", "timeout", "incorrect")


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
