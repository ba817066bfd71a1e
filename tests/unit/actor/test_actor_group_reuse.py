"""ActorGroup's old-logprob bookkeeping (stages 5 and 6) on stand-in ranks: which rows each pass
fills, how the update's first forward completes them, and with pi_old from the engines
(``actor.old_logprobs=rollout``) that no pass runs and the forward only comes back (no Ray, no
DeepSpeed)."""

from __future__ import annotations

import pytest
import torch

from bandpo.actor.group import ActorGroup
from bandpo.algo.options import LossOptions
from bandpo.types import TrainBatch
from tests.helpers.batches import ones_batch

N, R, FIRST = 6, 3, 2  # rows, response width, rows of the first mini-batch


def _batch() -> TrainBatch:
    # the engines' log-probs, distinct from the actor's
    return ones_batch(N, R, -torch.arange(1.0, N * R + 1).view(N, R) / 10)


class _Group(ActorGroup):
    """Log-probs of row i are -(i + 1), entropies i + 1; the first forward reports -100 / 100."""

    def __init__(self, reuse, from_rollout=False):
        self.reuse_old, self.old_from_rollout, self.first_rows, self.calls = reuse, from_rollout, FIRST, []

    def compute_logprobs(self, batch, with_entropy=False, ref=False):
        # the batch's tail rows
        rows = torch.arange(N - batch.size, N, dtype=torch.float32)[:, None].expand(-1, R)
        self.calls.append(("logprobs", batch.size))
        return -(rows + 1), rows + 1

    def update_on_policy(self, batch, options):
        self.calls.append(("on_policy", batch.old_logprobs is None))
        self.old_seen = None if batch.old_logprobs is None else batch.old_logprobs.clone()
        first = torch.zeros(N, R)
        first[:FIRST] = 100.0
        return {"nonfinite_steps": 1, "optimizer_steps": 3}, -first, first

    def update_epoch(self, batch, options):
        self.calls.append(("update", None))
        return {"nonfinite_steps": 0, "optimizer_steps": 3}


def test_without_reuse_every_row_is_computed_and_the_update_adds_nothing():
    g, b = _Group(reuse=False), _batch()
    entropy = g.old_logprobs(b)
    assert g.calls == [("logprobs", N)]
    assert torch.equal(b.old_logprobs[:, 0], -torch.arange(1.0, N + 1)) and torch.equal(
        entropy[:, 0], torch.arange(1.0, N + 1)
    )
    out = g.update(b, LossOptions(), epochs=2, entropy=entropy)
    assert g.calls[1:] == [("update", None), ("update", None)]
    assert (out.nonfinite_steps, out.optimizer_steps) == (0, 6) and out.entropy is entropy  # complete already


def test_with_reuse_later_rows_first_then_the_first_forward_fills_the_rest():
    g, b = _Group(reuse=True), _batch()
    entropy = g.old_logprobs(b)
    assert g.calls == [("logprobs", N - FIRST)]
    assert torch.equal(b.old_logprobs[:, 0], torch.tensor([0.0, 0.0, -3, -4, -5, -6]))  # first rows pending
    out = g.update(b, LossOptions(), epochs=2, entropy=entropy)
    assert g.calls[1:] == [("on_policy", False), ("update", None)]  # epoch 0 on-policy, epoch 1 plain
    assert torch.equal(b.old_logprobs[:, 0], torch.tensor([-100.0, -100, -3, -4, -5, -6]))
    assert out.entropy is entropy and torch.equal(entropy[:, 0], torch.tensor([100.0, 100, 3, 4, 5, 6]))
    assert (out.nonfinite_steps, out.optimizer_steps) == (1, 6)
    # the step's logged counts are both epochs' (3 + 3 steps, 1 + 0 discarded), not the last pass's
    assert (out.metrics["nonfinite_steps"], out.metrics["optimizer_steps"]) == (1.0, 6.0)


def test_with_reuse_and_one_mini_batch_no_pass_runs():
    g, b = _Group(reuse=True), _batch().select(slice(0, FIRST))
    assert g.old_logprobs(b) is None and b.old_logprobs is None and g.calls == []
    out = g.update(b, LossOptions(), epochs=1, entropy=None)
    assert g.calls == [("on_policy", True)]
    assert torch.equal(b.old_logprobs[:FIRST, 0], torch.tensor([-100.0, -100])) and out.entropy is not None


def test_with_old_logprobs_from_rollout_no_pass_runs_and_the_first_forward_only_comes_back():
    g, b = _Group(reuse=False, from_rollout=True), _batch()
    assert g.old_logprobs(b) is None and g.calls == []  # no old-logprob pass, no entropy
    assert torch.equal(b.old_logprobs, b.rollout_logprobs)  # every row: pi_old is the engines'
    assert b.old_logprobs is not b.rollout_logprobs  # a copy: writing one leaves the other
    out = g.update(b, LossOptions(), epochs=2, entropy=None)
    assert g.calls == [("on_policy", False), ("update", None)]
    # the update read the engines' log-probs for every row, the first mini-batch's included, and
    # wrote nothing over them
    assert torch.equal(g.old_seen, b.rollout_logprobs) and torch.equal(b.old_logprobs, b.rollout_logprobs)
    # the first forward's rows come back for the step's metrics: log-probs -100, entropy 100
    assert torch.equal(out.actor_logprobs, torch.full((FIRST, R), -100.0))
    assert torch.equal(out.entropy, torch.full((FIRST, R), 100.0))
    assert (out.nonfinite_steps, out.optimizer_steps) == (1, 6)


def test_with_old_logprobs_recomputed_the_result_has_no_actor_logprobs():
    for reuse in (False, True):
        g, b = _Group(reuse=reuse), _batch()
        out = g.update(b, LossOptions(), epochs=1, entropy=g.old_logprobs(b))
        assert out.actor_logprobs is None


def test_reuse_and_old_logprobs_from_rollout_exclude_each_other():
    with pytest.raises(ValueError, match="reuse_old_logprobs and old_from_rollout"):
        ActorGroup("model", 1, reuse_old_logprobs=True, old_from_rollout=True)
