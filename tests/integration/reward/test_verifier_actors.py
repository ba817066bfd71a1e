"""The verifier as Ray actors: real Ray, real process pools, real math-verify."""

from __future__ import annotations

import threading

import pytest

from bandpo.reward import RewardScheme, RewardScorer

pytestmark = pytest.mark.integration

HANG = "So the answer is \\boxed{9^{9^{9^{9^{9}}}}}"  # sympy evaluates the tower: a timeout
SCHEME = RewardScheme(
    correct=1.0, incorrect=-1.0, format_penalty=-0.5, overlong_buffer=4, max_response_len=10
)
TIMEOUT = 2.0


def _batch() -> tuple[list, list, list[int]]:
    """Every status the pool gives, at known places, with lengths that trigger overlong shaping."""
    responses, answers = [], []
    for i in range(11):
        responses.append(f"Answer: {i}")
        answers.append(str(i if i % 3 else i + 1))  # every third item is wrong
    responses[4], answers[4] = "I do not know", "4"  # no_answer
    responses[6] = None  # invalid_input
    responses[9], answers[9] = HANG, "5"  # timeout
    lengths = [3, 10, 7, 1, 2, 3, 4, 5, 9, 6, 8]
    return responses, answers, lengths


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """What today's in-driver pool gives for the batch."""
    responses, answers, lengths = _batch()
    with RewardScorer(SCHEME, answer_format="auto", num_workers=1, timeout=TIMEOUT) as scorer:
        return scorer.score(responses, answers, lengths)


def _fields(scores):
    return [(s.status, s.extracted, s.reward) for s in scores]


def test_reference_batch_covers_every_status(reference):
    statuses = [s.status for s in reference]
    assert statuses[4] == "no_answer" and statuses[6] == "invalid_input" and statuses[9] == "timeout"
    assert statuses[0] == "incorrect" and statuses[1] == "correct"
    # Overlong shaping (L=10, B=4): length 10 at item 1 gets -1 * (10 - 6) / 4 = -1 on top of +1.
    assert reference[1].reward == pytest.approx(0.0)


def test_split_over_actors_keeps_order(ray_local, reference):
    from bandpo.reward.ray_scorer import RayScorer

    responses, answers, lengths = _batch()
    scorer = RayScorer(SCHEME, answer_format="auto", num_workers=1, timeout=TIMEOUT, actors=3)
    try:
        assert _fields(scorer.score(responses, answers, lengths)) == _fields(reference)
        # Fewer items than actors: idle actors get nothing, nothing is dropped.
        assert _fields(scorer.score(responses[:2], answers[:2], lengths[:2])) == _fields(reference[:2])
        assert scorer.score([], [], []) == []
        with pytest.raises(ValueError, match="answers"):
            scorer.score(responses, answers[:3])
    finally:
        scorer.close()


def test_killed_actor_is_replaced_and_its_items_regraded(ray_local, reference):
    from bandpo.reward.ray_scorer import RayScorer

    ray = ray_local
    responses, answers, lengths = _batch()
    scorer = RayScorer(SCHEME, answer_format="auto", num_workers=1, timeout=TIMEOUT, actors=2)
    try:
        # Dead before the call: its chunk (items 0..5) fails at once and is regraded.
        ray.kill(scorer.actors[0])
        assert _fields(scorer.score(responses, answers, lengths)) == _fields(reference)
        assert scorer.replaced == 1

        # Killed mid-grading: actor 1's chunk (items 6..10) holds the timeout item, so it is busy
        # for TIMEOUT seconds when the kill lands; the replacement grades all five again.
        victim = scorer.actors[1]
        killer = threading.Timer(TIMEOUT / 2, ray.kill, args=(victim,))
        killer.start()
        got = scorer.score(responses, answers, lengths)
        killer.join()
        assert _fields(got) == _fields(reference)
        # The call itself saw the death (a kill landing after it returned would leave this at 1).
        assert scorer.replaced == 2 and scorer.actors[1] is not victim
    finally:
        scorer.close()
