"""bandpo.split: the ranges the verifier actors grade, same as the rollout engines' split."""

import pytest

from bandpo.split import split_evenly


def test_split_evenly():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert split_evenly(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="at least one worker"):
        split_evenly(3, 0)


def test_same_ranges_as_the_rollout_split():
    from bandpo.rollout.worker import split_evenly as rollout_split

    for n in range(12):
        for k in range(1, 5):
            assert split_evenly(n, k) == rollout_split(n, k)
