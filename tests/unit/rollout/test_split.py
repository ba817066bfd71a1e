"""bandpo.split: the contiguous ranges the rollout engines generate and the verifier actors grade."""

import pytest

from bandpo.split import split_evenly


def test_split_evenly():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert split_evenly(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="at least one worker"):
        split_evenly(3, 0)
