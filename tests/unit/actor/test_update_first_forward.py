"""``Actor.update_on_policy`` on a stand-in engine and forward (no DeepSpeed, no model): which old
log-probs the first optimizer step's loss reads, and what comes back from that step's forward."""

from __future__ import annotations

import pytest
import torch

from bandpo.actor import worker
from bandpo.actor.worker import Actor
from bandpo.algo.options import LossOptions
from bandpo.types import TrainBatch
from tests.helpers.batches import ones_batch

N, R, MINI = 4, 3, 2  # rows, response width, rows per optimizer step (two steps)


class _Engine:
    """DeepSpeed's engine as ``Actor._update`` calls it; every step applies."""

    def train(self):
        pass

    def get_lr(self):
        return [1e-6]

    def set_gradient_accumulation_boundary(self, last):
        pass

    def backward(self, loss, scale_wrt_gas):
        pass

    def step(self):
        pass

    def get_global_grad_norm(self):
        return 1.0

    def was_step_applied(self):
        return True


def _actor() -> Actor:
    a = Actor.__new__(Actor)
    a.world_size, a.mini_batch_size, a.micro_batch_size = 1, MINI, MINI
    a.max_tokens_per_micro_batch, a.device, a.on_cpu, a.engine = 0, torch.device("cpu"), True, _Engine()
    # the forward's log-probs of row i are -(i + 1), its entropy i + 1
    a._forward = lambda engine, mb, entropy_grad: (
        -(mb.prompt_index.float()[:, None] + 1).expand(-1, R).clone().requires_grad_(),
        (mb.prompt_index.float()[:, None] + 1).expand(-1, R).clone(),
        mb.response_mask,
    )
    return a


def _batch() -> TrainBatch:
    return ones_batch(
        N,
        R,
        torch.full((N, R), -7.0),
        advantages=torch.ones(N),
        old_logprobs=torch.full((N, R), -7.0),  # the engines' (actor.old_logprobs=rollout)
    )


@pytest.fixture
def losses(monkeypatch):
    """The (old log-probs, token fields) each micro-batch's loss was given."""
    seen = []

    def policy_loss(logprobs, old, advantages, mask, options, **kw):
        seen.append((old.clone(), kw.get("old_entropy")))
        return (logprobs * 0).sum(), {}

    monkeypatch.setattr(worker, "policy_loss", policy_loss)
    return seen


def test_as_old_false_reads_the_batch_s_old_logprobs_and_returns_the_forward(losses):
    metrics, lp, ent = _actor().update_on_policy(_batch(), LossOptions(), as_old=False)
    # both steps' losses took the batch's old log-probs, the first step's too; no entropy of pi_old
    assert [torch.equal(old, torch.full((MINI, R), -7.0)) for old, _ in losses] == [True, True]
    assert [e is None for _, e in losses] == [True, True]
    # the first step's forward comes back: rows 0-1 filled, the later rows 0
    assert torch.equal(lp[:, 0], torch.tensor([-1.0, -2.0, 0.0, 0.0]))
    assert torch.equal(ent[:, 0], torch.tensor([1.0, 2.0, 0.0, 0.0]))
    assert metrics["optimizer_steps"] == 2


def test_as_old_true_takes_the_first_step_s_old_logprobs_from_its_forward(losses):
    _, lp, ent = _actor().update_on_policy(_batch(), LossOptions())
    first, later = losses
    assert torch.equal(first[0][:, 0], torch.tensor([-1.0, -2.0])) and first[1] is not None
    assert torch.equal(later[0], torch.full((MINI, R), -7.0)) and later[1] is None
    assert torch.equal(lp[:, 0], torch.tensor([-1.0, -2.0, 0.0, 0.0]))
    assert torch.equal(ent[:, 0], torch.tensor([1.0, 2.0, 0.0, 0.0]))
