"""The rollout entropy split by ended responses, their first tokens, per response and by length quartile,
against numbers worked by hand (the values are small binary fractions, so the sums are exact in float32)."""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.trainer.step_metrics import actor_metrics, entropy_split_metrics
from tests.helpers.batches import ones_batch

NAN = math.nan

# [4, 5]: row 0 ends after 2 tokens, row 1 after 4, row 2 is cut at 5, row 3 ends after 2 (a tie with row 0);
# entries off the mask are NaN and must not leak in.
ENTROPY = torch.tensor(
    [
        [1.0, 3.0, NAN, NAN, NAN],
        [2.0, 2.0, 2.0, 6.0, NAN],
        [0.5, 0.5, 0.5, 0.5, 0.5],
        [4.0, 0.0, NAN, NAN, NAN],
    ]
)
MASK = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])  # [4, 5]
ENDED = torch.tensor([True, True, False, True])  # [4]


def test_the_split_matches_the_hand_computed_numbers():
    out = entropy_split_metrics(ENTROPY, MASK, ENDED, first_n=2)
    expected = {
        # ended rows 0, 1, 3: tokens 1+3 + 2+2+2+6 + 4+0 = 20 over 8
        "entropy/ended": 20 / 8,
        # their first 2 tokens: 1+3 + 2+2 + 4+0 = 12 over 6
        "entropy/ended_first_n": 12 / 6,
        # row means 2, 3, 0.5, 2, each weighing 1/4 (the token mean over all rows is 22.5/13 = 1.73)
        "entropy/seq_mean": (2 + 3 + 0.5 + 2) / 4,
        # lengths sorted 2, 2, 4, 5: bounds s[ceil(q*4/4) - 1] = 2, 2, 4, 5; both length-2 rows go to q1,
        # which leaves q2 empty (absent)
        "response/len_q1_max": 2.0,
        "response/len_q2_max": 2.0,
        "response/len_q3_max": 4.0,
        "response/len_q4_max": 5.0,
        "entropy/len_q1": (1 + 3 + 4 + 0) / 4,
        "entropy/len_q3": 12 / 4,
        "entropy/len_q4": 0.5,
    }
    assert out == pytest.approx(expected, abs=0)
    assert set(out) == set(expected)


def test_first_n_beyond_every_length_is_the_ended_mean():
    out = entropy_split_metrics(ENTROPY, MASK, ENDED, first_n=32)
    assert out["entropy/ended_first_n"] == out["entropy/ended"] == 20 / 8


def test_quartile_bounds_with_five_lengths():
    # lengths 1..5 (rows valid up to their length), entropy = the row's length on each valid token:
    # bounds s[ceil(q*5/4) - 1] = s[1], s[2], s[3], s[4] = 2, 3, 4, 5, so q1 holds lengths 1 and 2:
    # tokens 1 + 2+2 = 5 over 3
    lengths = torch.arange(1, 6)  # [5]
    mask = (torch.arange(5)[None, :] < lengths[:, None]).long()  # [5, 5]
    entropy = lengths[:, None].float().expand(5, 5)  # [5, 5]
    out = entropy_split_metrics(entropy, mask, torch.ones(5, dtype=torch.bool), first_n=1)
    assert [out[f"response/len_q{q}_max"] for q in range(1, 5)] == [2.0, 3.0, 4.0, 5.0]
    assert [out[f"entropy/len_q{q}"] for q in range(1, 5)] == pytest.approx([5 / 3, 3.0, 4.0, 5.0], abs=0)
    # the first token of each: 1+2+3+4+5 over 5
    assert out["entropy/ended_first_n"] == 3.0


def test_empty_sets_leave_their_metrics_out():
    none_ended = entropy_split_metrics(ENTROPY, MASK, torch.zeros(4, dtype=torch.bool), first_n=2)
    assert "entropy/ended" not in none_ended and "entropy/ended_first_n" not in none_ended
    assert not any(math.isnan(v) for v in none_ended.values())
    # a row without a valid token: length 0 in q1, no mean of its own
    mask = MASK.clone()
    mask[1] = 0
    out = entropy_split_metrics(ENTROPY, mask, ENDED, first_n=2)
    assert out["entropy/seq_mean"] == (2 + 0.5 + 2) / 3
    assert out["response/len_q1_max"] == 0.0 and "entropy/len_q1" not in out
    assert not any(math.isnan(v) for v in out.values())
    empty = entropy_split_metrics(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, dtype=torch.bool), 2)
    assert empty == {}


def test_actor_metrics_split_by_the_batch_s_finish_reasons():
    batch = ones_batch(4, 5, torch.zeros(4, 5))
    batch.response_mask, batch.finish_reasons = MASK, ["stop", "stop", "length", "stop"]
    out = actor_metrics(batch, torch.zeros(4, 5), ENTROPY, first_n=2)
    assert out["actor/entropy"] == pytest.approx(22.5 / 13, rel=1e-6)  # float32 mean of 13 values
    assert out["entropy/ended"] == 20 / 8 and out["entropy/ended_first_n"] == 12 / 6
