"""Reward-pool workers under OS-level faults: stopped (SIGSTOP), killed mid-batch, hung inside a chunk,
and over their address-space cap. Real process pools that wait out their watchdogs and timeouts;
the pool's grading itself is covered by tests/unit/reward/."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from bandpo.reward import RewardScorer
from tests.unit.reward.test_reward_pool import (
    HANG,
    _descendants,
    _kill_busy_worker,
    _normal_items,
    _slow_items,
    _workers,
)
from tests.unit.reward.test_verifier_faults import _python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

POWER_RESPONSE = "Answer: $2^{2^{29}}$"
GRADE_WITH_PEAK = """
import re, sys
from bandpo.reward.pool_health import init_worker
from bandpo.reward.verify import verify_one
cap = int(sys.argv[1])
init_worker(cap or None)  # what each pool worker does first: the cap (0 = none), the parser's warm-up
status, _ = verify_one(sys.argv[2], "4")
# Peak RSS of this process image in MiB (VmHWM; ru_maxrss would carry pytest's over fork + exec).
print(status, int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) >> 10)
"""
CAP = 256 << 20  # 3-4x what a grading process maps


def test_worker_killed_mid_batch_is_replaced_and_its_item_retried():
    # Either worker may be the one killed: the one stuck on the tower or one grading the
    # slow items. Both ways every item keeps its grade and the batch completes.
    timeout = 2.0
    responses, golds = _slow_items(80)
    responses[33] = HANG
    baseline = _descendants()
    with RewardScorer(num_workers=2, timeout=timeout) as scorer:
        scorer.score(["Answer: 1"], ["1"])
        result = {}
        thread = threading.Thread(target=lambda: result.update(scores=scorer.score(responses, golds)))
        thread.start()
        killed = _kill_busy_worker(baseline)
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
        scores = result["scores"]
        # A killed run does not count against its item: it is rerun.
        assert [s.status for s in scores] == ["timeout" if i == 33 else "correct" for i in range(80)]
        assert all(s.status == "correct" for s in scorer.score(*_normal_items(20)))


def test_wedged_pool_is_replaced(monkeypatch):
    # Stopped (SIGSTOP) workers never pick up a task, so no per-task timeout ever starts:
    # only the watchdog notices that nothing completes.
    from bandpo.reward import pool

    monkeypatch.setattr(pool, "STALL_GRACE_S", 1.0)
    monkeypatch.setattr(pool, "STOP_WAIT_S", 1.0)  # the stopped workers cannot exit: abandon them sooner
    baseline = _descendants()
    with RewardScorer(num_workers=2, timeout=1.0) as scorer:
        scorer.score(["Answer: 1"], ["1"])
        stopped = _workers(baseline)
        for p in stopped:
            p.suspend()
        start = time.monotonic()
        try:
            scores = scorer.score(*_normal_items(10))
        finally:
            for p in stopped:  # let the abandoned workers see their termination and exit
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.resume()
        assert [s.status for s in scores] == ["correct"] * 10
        assert time.monotonic() - start < 20


def test_hang_inside_a_chunk_is_isolated(monkeypatch):
    from bandpo.reward import pool

    monkeypatch.setattr(pool, "_is_simple", lambda answer: True)  # trust even the tower
    timeout = 1.5
    responses, golds = _normal_items(10)
    golds = ["5"] * 10
    responses = [f"Answer: {5 if i % 2 else 6}" for i in range(10)]
    responses[4] = HANG
    with RewardScorer(num_workers=2, timeout=timeout) as scorer:
        scorer.score(["Answer: 1"], ["1"])
        start = time.monotonic()
        scores = scorer.score(responses, golds)
        elapsed = time.monotonic() - start
    expected = ["timeout" if i == 4 else ("correct" if i % 2 else "incorrect") for i in range(10)]
    assert [s.status for s in scores] == expected
    assert elapsed < 2 * timeout + 2.0  # the chunk's timeout, then the item's own


def test_a_response_that_allocates_stays_under_the_workers_cap():
    # Uncapped, grading the response peaks at ~410 MiB of RSS (409 MiB measured here, twice):
    # above the cap, so it does try. Under the cap the allocation fails inside the grader: the
    # item is still graded and the process, by the kernel's RLIMIT_AS, never passes 256 MiB.
    # Both gradings run side by side (separate processes: each peak is its own).
    with ThreadPoolExecutor(2) as pool:
        uncapped, out = pool.map(
            lambda cap: _python(["-c", GRADE_WITH_PEAK, str(cap), POWER_RESPONSE]), (0, CAP)
        )
    status, peak = uncapped.stdout.split()
    assert int(peak) > CAP >> 20, peak
    assert out.returncode == 0, out.stderr[-2000:]
    status, peak = out.stdout.split()
    assert status in ("incorrect", "error") and int(peak) < CAP >> 20, out.stdout


def test_the_pool_grades_on_after_a_response_hits_the_cap():
    with RewardScorer(num_workers=1, memory_cap_gib=CAP / 2**30, timeout=10) as scorer:
        scores = scorer.score(["Answer: 3", POWER_RESPONSE, "Answer: $\\frac{1}{2}$"], ["3", "4", "0.5"])
    assert [s.status for s in scores] in (
        ["correct", "incorrect", "correct"],
        ["correct", "error", "correct"],
    )
