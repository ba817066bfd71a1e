"""The reward pool: same grades as in-process, hard timeouts, killed workers, broken pools."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from bandpo.reward import RewardScheme, RewardScorer, pool, score_batch, verify_one
from tests.unit.reward.test_reward import CASES

pytestmark = pytest.mark.timeout(120)

HANG = "So the answer is \\boxed{9^{9^{9^{9^{9}}}}}"  # sympy evaluates the tower: never ends
HANG_2 = "Answer: 10^{10^{100}}"


def _normal_items(n: int) -> tuple[list[str], list[str]]:
    responses = [f"Some work.\nAnswer: {i}" if i % 3 else f"so $\\boxed{{{i}}}$" for i in range(n)]
    return responses, [str(i) for i in range(n)]


def _slow_items(n: int) -> tuple[list[str], list[str]]:
    """Items of ~20 ms each (distinct LaTeX, symbolic comparison), all correct."""
    responses = [f"Answer: \\frac{{{i}}}{{{i + 1}}} + \\sqrt{{{i + 2}}}" for i in range(n)]
    return responses, [f"\\sqrt{{{i + 2}}} + \\frac{{{i}}}{{{i + 1}}}" for i in range(n)]


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _workers(baseline: set[int]) -> list[psutil.Process]:
    """Pool workers started since ``baseline`` (a ``_descendants()`` snapshot).

    Workers are forked by the fork server, i.e. grandchildren of this process; the
    baseline keeps processes of other tests and scorers out.
    """
    me = psutil.Process()
    workers = []
    for p in me.children(recursive=True):
        try:
            if p.pid not in baseline and p.ppid() != me.pid:
                workers.append(p)
        except psutil.NoSuchProcess:  # a worker that ended while we looked
            pass
    return workers


def _kill_busy_worker(baseline: set[int], deadline_s: float = 30.0, burnt_s: float = 0.3) -> int:
    """SIGKILL the worker that is grading (the hanging item spins on its CPU); returns its pid.

    It is told apart by CPU seconds burnt while we watch, not by a CPU share over a short window: a
    loaded 2-core machine gives the spinning worker well under 10% of a core in some windows, while
    an idle worker burns nothing and the spinning one passes 0.3 s within seconds whatever the load.
    A worker's total since its fork would not do: the first grade's lazy imports cost more than that."""
    end = time.monotonic() + deadline_s
    first_seen: dict[int, float] = {}
    while time.monotonic() < end:
        burnt = []
        for seconds, pid in _cpu_seconds(_workers(baseline)):
            first_seen.setdefault(pid, seconds)
            burnt.append((seconds - first_seen[pid], pid))
        if burnt and max(burnt)[0] >= burnt_s:
            pid = max(burnt)[1]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it finished and was replaced meanwhile: look again
                continue
            return pid
        time.sleep(0.1)
    raise AssertionError(f"no worker burnt {burnt_s} s of CPU within {deadline_s} s")


def _cpu_seconds(procs: list[psutil.Process]) -> list[tuple[float, int]]:
    """(user + system CPU seconds since its fork, pid) of each process still there."""
    out = []
    for p in procs:
        try:
            t = p.cpu_times()
            out.append((t.user + t.system, p.pid))
        except psutil.NoSuchProcess:
            pass
    return out


def _kill_all(procs: list[psutil.Process]) -> int:
    """SIGKILL ``procs``; returns how many were still there to kill."""
    killed = 0
    for p in procs:
        try:
            p.kill()
            killed += 1
        except psutil.NoSuchProcess:
            pass
    return killed


@pytest.fixture(scope="module")
def scorers():
    made = {
        fmt: RewardScorer(answer_format=fmt, num_workers=2, timeout=5.0) for fmt in ("auto", "dapo", "boxed")
    }
    yield made
    for scorer in made.values():
        scorer.close()


@pytest.mark.parametrize("fmt", ["auto", "dapo", "boxed"])
def test_pool_grades_like_verify_one(scorers, fmt):
    cases = [c for c in CASES if (c[3] if len(c) > 3 else "auto") == fmt]
    responses = [c[0] for c in cases]
    golds = [c[1] for c in cases]
    scores = scorers[fmt].score(responses, golds)
    assert [s.status for s in scores] == [c[2] for c in cases]
    assert [s.extracted for s in scores] == [verify_one(r, g, fmt)[1] for r, g in zip(responses, golds)]
    assert all(s.correct == (s.status == "correct") for s in scores)
    assert all(s.reward == (1.0 if s.correct else -1.0) for s in scores)


def test_pool_without_dedupe_or_chunks_grades_the_same(scorers):
    responses = [c[0] for c in CASES if len(c) == 3]
    golds = [c[1] for c in CASES if len(c) == 3]
    expected = [s.status for s in scorers["auto"].score(responses, golds)]
    with RewardScorer(num_workers=2, dedupe=False, chunk_size=1) as plain:
        assert [s.status for s in plain.score(responses, golds)] == expected


def test_order_is_preserved_and_duplicates_are_graded_once(scorers):
    responses, golds = _normal_items(200)
    responses += ["Answer: 5"] * 50
    golds += ["5"] * 50
    scores = scorers["auto"].score(responses, golds)
    assert len(scores) == 250
    assert all(s.status == "correct" for s in scores)
    assert [s.extracted for s in scores[:200]] == [str(i) for i in range(200)]


# The hang tests wait out their timeouts, so these are as short as the honest items allow: a warm
# pool grades the 30 simple items below in 4-15 ms (a chunk's slowest item took 3 ms; measured on the
# 2-core test machine), and a machine loaded ~10x over (a process gets a tenth of a core) makes that
# ~0.15 s. 0.5 s is over 3x that, so an honest chunk never times out, and a hang still costs the whole
# timeout, which is what the tests time.
HANG_TIMEOUT_S = 0.5


def test_hang_times_out_within_limit_and_others_are_scored():
    timeout = HANG_TIMEOUT_S
    responses, golds = _normal_items(30)
    responses[7], responses[20] = HANG, HANG_2
    with RewardScorer(num_workers=2, timeout=timeout) as scorer:
        scorer.score(["Answer: 1"], ["1"])  # start the workers outside the timed call
        start = time.monotonic()
        scores = scorer.score(responses, golds)
        elapsed = time.monotonic() - start
    assert elapsed < timeout + 2.0
    assert [s.status for s in scores] == ["timeout" if i in (7, 20) else "correct" for i in range(30)]
    assert scores[7].extracted == "9^{9^{9^{9^{9}}}}"
    assert scores[7].reward == -1.0 and scores[7].seconds == timeout


def test_identical_hangs_cost_one_timeout():
    timeout = HANG_TIMEOUT_S
    with RewardScorer(num_workers=2, timeout=timeout) as scorer:
        scorer.score(["Answer: 1"], ["1"])
        start = time.monotonic()
        scores = scorer.score([HANG] * 6 + ["Answer: 2"], ["5"] * 6 + ["2"])
        elapsed = time.monotonic() - start
    assert [s.status for s in scores] == ["timeout"] * 6 + ["correct"]
    assert elapsed < timeout + 2.0


def test_item_whose_worker_dies_twice_is_an_error():
    baseline = _descendants()
    # The hanging item's timeout must outlast both kills: each search waits for 0.3 CPU seconds
    # (seconds of wall time on a loaded machine), and a replacement worker starts in between; at 20 s
    # a loaded 2-core machine (load ~9) saw the timeout first ("timeout", not "error"). The kills end
    # the item long before 90 s when all is well.
    with RewardScorer(num_workers=2, timeout=90.0) as scorer:
        scorer.score(["Answer: 1"], ["1"])
        result = {}
        batch = (["Answer: 1", HANG, "Answer: 2"], ["1", "5", "2"])
        thread = threading.Thread(target=lambda: result.update(scores=scorer.score(*batch)))
        thread.start()
        _kill_busy_worker(baseline)
        _kill_busy_worker(baseline)
        thread.join(timeout=120)
        assert not thread.is_alive()
        assert [s.status for s in result["scores"]] == ["correct", "error", "correct"]


def test_batch_survives_all_workers_being_killed_repeatedly(monkeypatch):
    # A kill that lands while a worker holds pebble's task lock wedges the pool until the watchdog
    # replaces it, timeout + STALL_GRACE_S after the last start (15 s at the default 10 s grace: one
    # run in three spent 16 s here). At 3 s the watchdog still waits 8 s without a task starting or
    # finishing before it acts, which a healthy pool of 20 ms items never does.
    monkeypatch.setattr(pool, "STALL_GRACE_S", 3.0)
    responses, golds = _slow_items(120)
    baseline = _descendants()
    with RewardScorer(num_workers=2, timeout=5.0) as scorer:
        scorer.score(["Answer: 1"], ["1"])
        result = {}
        thread = threading.Thread(target=lambda: result.update(scores=scorer.score(responses, golds)))
        thread.start()
        kills = 0
        for _ in range(3):
            time.sleep(0.3)
            kills += _kill_all(_workers(baseline))
        thread.join(timeout=60)
        assert not thread.is_alive()
        statuses = [s.status for s in result["scores"]]
        assert len(statuses) == 120
        # Only an item whose worker was killed under it twice may be lost to "error".
        assert set(statuses) <= {"correct", "error"}
        assert statuses.count("error") <= kills // 2
        assert all(s.correct for s in scorer.score(*_normal_items(10)))


def test_pool_recovers_when_all_workers_die_between_batches():
    baseline = _descendants()
    with RewardScorer(num_workers=2, timeout=5.0) as scorer:
        assert all(s.correct for s in scorer.score(*_normal_items(10)))
        _kill_all(_workers(baseline))
        time.sleep(0.5)
        assert all(s.correct for s in scorer.score(*_normal_items(10)))


def test_invalid_inputs_and_argument_errors(scorers):
    scorer = scorers["auto"]
    scores = scorer.score([None, "Answer: 1", 3, "Answer: 2"], ["1", None, "3", "2"])
    assert [s.status for s in scores] == ["invalid_input", "invalid_input", "invalid_input", "correct"]
    with pytest.raises(ValueError, match="answers"):
        scorer.score(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="response_lengths"):
        scorer.score(["a"], ["1"], response_lengths=[1, 2])
    with pytest.raises(ValueError, match="answer_format"):
        RewardScorer(answer_format="latex")
    with pytest.raises(ValueError, match="timeout"):
        RewardScorer(timeout=0)


def test_closed_scorer_refuses_work():
    scorer = RewardScorer(num_workers=1)
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["Answer: 1"], ["1"])


def test_score_batch_with_overlong_shaping():
    scheme = RewardScheme(
        correct=1.0, incorrect=0.0, format_penalty=-0.5, overlong_buffer=100, max_response_len=1000
    )
    responses = ["Answer: 1", "Answer: 2", "no answer here", "Answer: 4"]
    golds = ["1", "3", "3", "4"]
    scores = score_batch(
        responses,
        golds,
        scheme=scheme,
        answer_format="dapo",
        num_workers=1,
        response_lengths=[10, 10, 10, 950],
    )
    assert [s.status for s in scores] == ["correct", "incorrect", "no_answer", "correct"]
    assert [s.reward for s in scores] == pytest.approx([1.0, 0.0, -0.5, 0.5])
    with pytest.raises(ValueError, match="response_lengths"):
        score_batch(responses, golds, scheme=scheme, num_workers=1)
