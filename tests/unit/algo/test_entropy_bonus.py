"""The entropy options on top of any surrogate (``bandpo.algo.entropy_bonus``): the top-entropy
selection's tie rule, the adaptive coefficient's update and its state, the refusals, and the trainer's
per-step coefficient. Their equality with TRL's code is ``test_cov_entropy_reference.py``."""

from __future__ import annotations

import pytest
import torch

from bandpo.actor.loss_metrics import MetricAccumulator
from bandpo.algo.entropy_bonus import (
    EntropyControl,
    EntropyController,
    applied_coef,
    entropy_controller,
    next_coef,
    top_entropy_mask,
)
from bandpo.algo.losses import policy_loss
from bandpo.algo.options import LossOptions
from bandpo.config import compose, loss_options
from bandpo.trainer import loop


def test_top_entropy_keeps_ties_at_the_quantile_and_never_padding():
    h = torch.tensor([[1.0, 2.0, 3.0, 3.0, 9.0], [0.5, 3.0, 3.0, 1.0, 0.0]])
    maskf = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    # valid values sorted: 0 .5 1 1 2 3 3 3 3; the 0.6 quantile (rho 0.4) at rank 4.8: between 2 and 3 -> 2.8
    keep = top_entropy_mask(h, maskf, 0.4)
    assert keep.tolist() == [[False, False, True, True, False], [False, True, True, False, False]]
    # rho 0.5: the median rank 4 is 2 itself: kept, with every 3
    assert top_entropy_mask(h, maskf, 0.5)[0].tolist() == [False, True, True, True, False]
    # rho 0: the maximum (3, four ties) only; rho 1: every valid token
    assert int(top_entropy_mask(h, maskf, 0.0).sum()) == 4
    assert torch.equal(top_entropy_mask(h, maskf, 1.0), maskf.bool())
    assert not top_entropy_mask(h, torch.zeros_like(maskf), 0.2).any()


def test_top_entropy_compares_in_float32_so_the_quantile_token_is_kept_in_float64():
    # a float64 value just below its float32 rounding: at rho 0 it is the maximum, and it is kept
    x = float(torch.tensor(1.1, dtype=torch.float32)) - 2.0**-40  # float32(x) > x
    assert float(torch.tensor(x, dtype=torch.float64).float()) > x
    h = torch.tensor([[0.5, x]], dtype=torch.float64)
    assert top_entropy_mask(h, torch.ones(1, 2, dtype=torch.float64), 0.0).tolist() == [[False, True]]


def test_the_loss_keeps_the_selected_tokens_and_the_bonus_acts_on_them():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    old = logp.clone()  # ratio 1: L = -A
    h = torch.tensor([[0.1, 2.0, 0.3, 1.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.float64)
    opts = LossOptions(
        algorithm="grpo", dual_clip=None, agg="token-mean", top_entropy_quantile=0.5, entropy_coef=0.1
    )
    loss, m = policy_loss(logp, old, torch.tensor([2.0], dtype=torch.float64), mask, opts, entropy=h)
    # kept: the entropies >= the median 0.9, i.e. 2.0 and 1.5; pg = -2 * 2 / 4 tokens; the bonus' token
    # mean is over the kept tokens (this micro-batch's own count, as TRL's bnpo; the trainer passes num_tokens)
    assert loss.item() == pytest.approx(-1.0 - 0.1 * (2.0 + 1.5) / 2, rel=1e-15)
    assert float(m["top_entropy/kept_frac"]) == 0.5 and float(m["top_entropy/entropy"]) == 1.75
    loss.backward()
    assert h.grad.tolist() == [[0.0, -0.05, 0.0, -0.05]]
    with pytest.raises(ValueError, match="needs the policy's entropy"):
        policy_loss(logp, old, torch.tensor([2.0]), mask, opts)


def test_the_kept_tokens_entropy_averages_over_micro_batches_by_kept_tokens():
    acc = MetricAccumulator()
    acc.add_micro(
        {"top_entropy/entropy": torch.tensor(2.0), "top_entropy/kept_frac": torch.tensor(0.5)},
        torch.tensor(4),
    )
    acc.add_micro(
        {"top_entropy/entropy": torch.tensor(5.0), "top_entropy/kept_frac": torch.tensor(0.25)},
        torch.tensor(4),
    )
    # 2 kept tokens of mean 2, 1 of 5: 9 / 3
    assert acc.reduce(lambda v: v)["top_entropy/entropy"] == pytest.approx(3.0, rel=1e-15)


def test_adaptive_coefficient_moves_toward_the_target_within_its_bounds():
    c = EntropyControl(target=1.0, delta=0.25, coef_min=0.0, coef_max=0.5)
    assert applied_coef(0.3, None, c) == 0.0  # no measurement yet
    assert applied_coef(0.3, 1.0, c) == 0.3 and applied_coef(0.3, 1.01, c) == 0.0
    assert next_coef(0.0, 0.9, c) == 0.25 and next_coef(0.4, 0.9, c) == 0.5  # capped
    assert next_coef(0.1, 1.5, c) == 0.0  # floored
    with pytest.raises(ValueError, match="measured entropy must be finite"):
        next_coef(0.1, float("nan"), c)
    with pytest.raises(ValueError, match="entropy_coef_max must be >= 0.5"):
        EntropyControl(target=1.0, coef_min=0.5, coef_max=0.1)


def test_controller_state_round_trips_and_a_checkpoint_without_it_is_refused():
    ctl = EntropyController(EntropyControl(target=1.0, delta=0.1), coef=0.2)
    assert ctl.step_coef() == 0.0
    metrics = ctl.observe({"entropy": 0.5})
    assert metrics == {
        "entropy_bonus/applied_coef": 0.0,
        "entropy_bonus/next_coef": pytest.approx(0.3),
        "entropy_bonus/measured": 0.5,
        "entropy_bonus/target": 1.0,
    }
    assert ctl.step_coef() == pytest.approx(0.3)
    again = EntropyController(EntropyControl(target=1.0, delta=0.1), coef=0.0)
    again.load_state_dict(ctl.state_dict(), "x")
    assert (again.coef, again.last_entropy) == (ctl.coef, ctl.last_entropy)
    with pytest.raises(ValueError, match="step_3/trainer_state.json: no entropy_control state"):
        again.load_state_dict(None, "step_3/trainer_state.json")
    # the kept tokens' entropy is what the control reads when the selection is on
    assert ctl.observe({"entropy": 0.5, "top_entropy/entropy": 2.0})["entropy_bonus/measured"] == 2.0


def test_the_trainer_applies_the_controllers_coefficient_each_step():
    cfg = compose(["algorithm=grpo", "algorithm.entropy_target=0.5", "algorithm.entropy_coef=0.01"])
    trainer = loop.Trainer.__new__(loop.Trainer)  # no run folder, no Ray: what step_loss_options reads
    trainer.loss = loss_options(cfg)
    trainer.entropy_ctl = entropy_controller(trainer.loss)
    assert trainer.step_loss_options(None).entropy_coef == 0.0  # nothing measured before the first update
    trainer.entropy_ctl.observe({"entropy": 0.4})  # below the target: the bonus turns on, one step up
    assert trainer.step_loss_options(None).entropy_coef == pytest.approx(0.015)
    trainer.entropy_ctl.observe({"entropy": 0.6})
    assert trainer.step_loss_options(None).entropy_coef == 0.0  # above the target: off (and c back to 0.01)
    assert trainer.entropy_ctl.coef == pytest.approx(0.01)
    off = loss_options(compose(["algorithm=grpo"]))
    assert entropy_controller(off) is None


def test_gspo_refuses_the_top_entropy_selection_with_the_reason():
    with pytest.raises(
        ValueError, match="top_entropy_quantile does not combine with algorithm=gspo .gspo's ratio"
    ):
        LossOptions(algorithm="gspo", dual_clip=None, top_entropy_quantile=0.2)
    LossOptions(
        algorithm="gspo", dual_clip=None, entropy_control=EntropyControl(target=1.0)
    )  # the bonus combines
