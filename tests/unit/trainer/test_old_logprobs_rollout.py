"""A training step with pi_old from the engines (``actor.old_logprobs=rollout``) and with the actor's
recomputed pi_old, on the real ``ActorGroup`` bookkeeping over stand-in ranks (no Ray): which passes
run, what pi_old the update reads, and which log-probs the step's health metrics and the
stale-weights check compare with the engines'."""

from __future__ import annotations

import pytest
import torch

from bandpo.actor.group import ActorGroup
from bandpo.config import compose, reuse_old_logprobs
from bandpo.parts import Workers
from bandpo.trainer import loop
from bandpo.trainer.dynamic_sampling import Drawn, Round
from bandpo.trainer.step_metrics import rollout_metrics
from bandpo.trainer.sync_check import StaleWeightsError
from bandpo.types import TrainBatch
from tests.helpers.actor import make_rollout
from tests.helpers.parts import fake_parts

N, FIRST = 4, 2  # rows (2 prompts x n = 2), rows of the first mini-batch (mini_batch_prompts = 1)
ACTOR_LP, ENTROPY = -0.5, 0.25  # the stand-in actor's log-prob and entropy of every token


class _Ranks(ActorGroup):
    """ActorGroup's own stage 5 and 6 over stand-in ranks: every forward gives ``ACTOR_LP`` /
    ``ENTROPY`` (the first update forward ``first_lp`` when set); the passes are recorded."""

    offloads = False

    def __init__(self, reuse, from_rollout, first_lp=None):
        self.reuse_old, self.old_from_rollout, self.first_rows = reuse, from_rollout, FIRST
        self.first_lp, self.calls = first_lp, []

    def compute_logprobs(self, batch, with_entropy=False, ref=False):
        self.calls.append(("ref" if ref else "old", batch.size))
        return torch.full(batch.response_ids.shape, ACTOR_LP), torch.full(batch.response_ids.shape, ENTROPY)

    def update_on_policy(self, batch, options):
        self.calls.append(("update_on_policy", None))
        self.old_read = None if batch.old_logprobs is None else batch.old_logprobs.clone()
        lp, ent = torch.zeros(N, batch.response_ids.shape[1]), torch.zeros(N, batch.response_ids.shape[1])
        lp[:FIRST] = ACTOR_LP if self.first_lp is None else self.first_lp
        ent[:FIRST] = ENTROPY
        return {"nonfinite_steps": 0, "optimizer_steps": 2}, lp, ent

    def update_epoch(self, batch, options):
        self.calls.append(("update_epoch", None))
        self.old_read = batch.old_logprobs.clone()
        return {"nonfinite_steps": 0, "optimizer_steps": 2}


class _Rollout:
    sleeps, drops_weights = False, False

    def wake_weights(self, load):
        pass

    def wake_kv_cache(self):
        pass


class _Drawer:
    """One batch of two groups whose engine log-probs differ per token (masked to 0 at padding)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def draw(self, step):
        rb = make_rollout(N, step)
        lp = -torch.arange(1.0, rb.response_ids.numel() + 1).view(rb.response_ids.shape) / 100
        rb.rollout_logprobs = lp * rb.response_mask  # [N, R]
        self.batch = TrainBatch.from_rollout(rb, rewards=torch.tensor([1.0, -1.0, 1.0, -1.0]))
        self.batch.prompt_index = torch.tensor([0, 0, 1, 1])  # [N]
        return Drawn(Round([0, 1], self.batch, ["a"] * N, []), {}, [], int(rb.response_mask.sum()))


def _trainer(old_logprobs, *overrides, first_lp=None, sync_tol=None):
    cfg = compose(
        [
            "rollout.n=2",
            "trainer.prompts_per_step=2",
            "actor.mini_batch_prompts=1",
            "actor.micro_batch_size=2",
            f"actor.old_logprobs={old_logprobs}",
            *overrides,
        ]
    )
    actor = _Ranks(reuse_old_logprobs(cfg), old_logprobs == "rollout", first_lp)
    workers = Workers(rollout=_Rollout(), actor=actor)
    trainer = loop.Trainer(cfg, fake_parts(cfg, workers=workers, sync_tol=sync_tol))
    trainer.step = 1
    trainer.drawer = _Drawer(trainer)  # stand-ins for the drawer and the sync (no Ray)
    trainer.sync_weights = lambda: None
    return trainer, actor


def _expected_health(batch, rows, actor_lp):
    """|log pi_rollout - log pi_actor| over the valid tokens of the batch's first ``rows`` rows."""
    mask = batch.response_mask[:rows].bool()
    return (batch.rollout_logprobs[:rows] - actor_lp)[mask].abs().mean().item()


@pytest.mark.parametrize("kl_coef", [0.0, 0.01])
def test_rollout_runs_no_old_pass_and_the_update_reads_the_engines_logprobs_on_every_row(
    monkeypatch, kl_coef
):
    monkeypatch.setattr(loop, "reward_metrics", lambda scores: {})
    trainer, actor = _trainer("rollout", f"algorithm.kl_coef={kl_coef}")
    metrics = trainer.train_step()
    batch = trainer.drawer.batch
    ref = [("ref", N)] if kl_coef > 0 else []  # the reference pass still covers every row
    assert actor.calls == [*ref, ("update_on_policy", None)]  # no "old" pass
    assert torch.equal(actor.old_read, batch.rollout_logprobs)  # pi_old of every row, the first's too
    assert torch.equal(batch.old_logprobs, batch.rollout_logprobs)  # the first forward wrote nothing over it
    assert "time/logprobs" in metrics and "time/update" in metrics
    # the health metrics: the first mini-batch's rows, against the update's first forward
    assert metrics["health/rollout_actor_abs_diff"] == _expected_health(batch, FIRST, ACTOR_LP)
    assert metrics["mismatch/log_ratio_abs_mean"] == pytest.approx(metrics["health/rollout_actor_abs_diff"])
    assert metrics["actor/entropy"] == ENTROPY


@pytest.mark.parametrize("reuse", ["true", "false"])
def test_recompute_compares_every_row_s_pi_old(monkeypatch, reuse):
    monkeypatch.setattr(loop, "reward_metrics", lambda scores: {})
    trainer, actor = _trainer("recompute", "algorithm.kl_coef=0", f"actor.reuse_old_logprobs={reuse}")
    metrics = trainer.train_step()
    batch = trainer.drawer.batch
    if reuse == "true":  # the later rows' pass, then the first forward fills the first rows
        assert actor.calls == [("old", N - FIRST), ("update_on_policy", None)]
    else:
        assert actor.calls == [("old", N), ("update_epoch", None)]
    assert torch.equal(batch.old_logprobs, torch.full(batch.old_logprobs.shape, ACTOR_LP))
    entropy = torch.full(batch.old_logprobs.shape, ENTROPY)
    expected = rollout_metrics(batch, entropy, trainer.cfg.trainer.entropy_first_n)
    assert metrics["health/rollout_actor_abs_diff"] == expected["health/rollout_actor_abs_diff"]
    assert metrics["health/rollout_actor_abs_diff"] == _expected_health(batch, N, ACTOR_LP)
    assert metrics["mismatch/log_ratio_abs_mean"] == expected["mismatch/log_ratio_abs_mean"]


@pytest.mark.parametrize("off_by, stops", [(0.0, False), (0.5, True)])
def test_the_stale_weights_check_reads_the_first_forward_with_rollout(monkeypatch, off_by, stops):
    # The forward matches the engines on the first rows (a healthy sync), or is 0.5 nats off (a stale
    # one); the step before was over the tolerance already, so a second excess stops the run.
    monkeypatch.setattr(loop, "reward_metrics", lambda scores: {})
    trainer, actor = _trainer("rollout", "algorithm.kl_coef=0", sync_tol=1e-4)
    draw = trainer.drawer.draw

    def draw_and_fix_the_forward(step):
        drawn = draw(step)
        actor.first_lp = drawn.round.batch.rollout_logprobs[:FIRST] - off_by
        return drawn

    trainer.drawer.draw = draw_and_fix_the_forward
    trainer.sync_over = True
    if stops:
        with pytest.raises(StaleWeightsError):
            trainer.train_step()
    else:
        metrics = trainer.train_step()
        assert metrics["mismatch/log_ratio_abs_mean"] == 0.0 and not trainer.sync_over
