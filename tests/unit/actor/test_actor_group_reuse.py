"""ActorGroup's old-logprob bookkeeping (stages 5 and 6) on stand-in ranks: which rows each pass
fills, and how the update's first forward completes them (no Ray, no DeepSpeed)."""

from __future__ import annotations

import torch

from bandpo.actor.group import ActorGroup
from bandpo.algo.options import LossOptions
from bandpo.types import TrainBatch

N, R, FIRST = 6, 3, 2  # rows, response width, rows of the first mini-batch


def _batch() -> TrainBatch:
    ids = torch.ones(N, R, dtype=torch.long)
    return TrainBatch(
        prompt_ids=ids,
        prompt_mask=ids,
        response_ids=ids,
        response_mask=ids,
        rollout_logprobs=torch.zeros(N, R),
        prompt_index=torch.arange(N),
        finish_reasons=["stop"] * N,
    )


class _Group(ActorGroup):
    """Log-probs of row i are -(i + 1), entropies i + 1; the first forward reports -100 / 100."""

    def __init__(self, reuse):
        self.reuse_old, self.first_rows, self.calls = reuse, FIRST, []

    def compute_logprobs(self, batch, with_entropy=False, ref=False):
        # the batch's tail rows
        rows = torch.arange(N - batch.size, N, dtype=torch.float32)[:, None].expand(-1, R)
        self.calls.append(("logprobs", batch.size))
        return -(rows + 1), rows + 1

    def update_on_policy(self, batch, options):
        self.calls.append(("on_policy", batch.old_logprobs is None))
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


def test_with_reuse_and_one_mini_batch_no_pass_runs():
    g, b = _Group(reuse=True), _batch().select(slice(0, FIRST))
    assert g.old_logprobs(b) is None and b.old_logprobs is None and g.calls == []
    out = g.update(b, LossOptions(), epochs=1, entropy=None)
    assert g.calls == [("on_policy", True)]
    assert torch.equal(b.old_logprobs[:FIRST, 0], torch.tensor([-100.0, -100])) and out.entropy is not None
