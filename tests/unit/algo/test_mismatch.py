"""Rollout/trainer mismatch correction: hand-computed weights of every mode, the loss they scale,
and the per-step statistics of the log-ratio.

k = pi_old / pi_rollout per token, chosen so that no k sits on a threshold (C = 2, 1/C = 0.5):
    row 0: 0.45/0.25 = 1.8, 0.1/0.4 = 0.25, 0.3/0.2 = 1.5      K0 = 1.8 * 0.25 * 1.5 = 0.675
    row 1: 0.6/0.6 = 1,     0.3/0.1 = 3,    padding (rollout logprob -inf)   K1 = 3
Float64 throughout: weights agree with these products to rounding (rel 1e-12).
"""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.algo import LossOptions, mismatch_stats, mismatch_weights, policy_loss

OLD = torch.log(torch.tensor([[0.45, 0.1, 0.3], [0.6, 0.3, 0.5]], dtype=torch.float64))
ROLLOUT = torch.log(torch.tensor([[0.25, 0.4, 0.2], [0.6, 0.1, 0.0]], dtype=torch.float64))  # log 0 = -inf
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])

# mode: (weights on valid tokens, share of valid tokens truncated / masked)
EXPECTED = {
    "token_tis": ([[1.8, 0.25, 1.5], [1.0, 2.0]], 1 / 5),  # 3 -> C
    "seq_tis": ([[0.675] * 3, [2.0, 2.0]], 2 / 5),  # K1 = 3 -> C on both of row 1's tokens
    "token_mis": ([[1.8, 0.25, 1.5], [1.0, 0.0]], 1 / 5),  # 3 > C dropped
    "seq_mis": ([[0.675] * 3, [0.0, 0.0]], 2 / 5),  # row 1 dropped whole
    "icepop": ([[1.8, 0.0, 1.5], [1.0, 0.0]], 2 / 5),  # 0.25 < 1/C and 3 > C dropped
}


def _valid(rows):
    return torch.tensor(rows[0] + rows[1] + [0.0], dtype=torch.float64)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_weights_hand_computed(mode):
    w, m = mismatch_weights(OLD, ROLLOUT, MASK.double(), mode, 2.0)
    rows, share = EXPECTED[mode]
    assert bool(torch.isfinite(w).all())  # the -inf rollout logprob on padding made no NaN
    got = w.flatten() * MASK.flatten()
    torch.testing.assert_close(got, _valid(rows), rtol=1e-12, atol=0)
    prefix, key = ("tis", "truncated_frac") if mode.endswith("tis") else ("mis", "masked_frac")
    assert m[f"{prefix}/{key}"].item() == pytest.approx(share, rel=1e-12)
    assert m[f"{prefix}/weight_mean"].item() == pytest.approx(sum(rows[0] + rows[1]) / 5, rel=1e-12)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_loss_is_scaled_per_token_without_gradient_through_the_weight(mode):
    # Ratio 1 (logp = old) with grpo: L = -A per token, so the loss is -sum(A w) / T and dL/dlogp = -A w / T.
    logp = OLD.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    opts = LossOptions(algorithm="grpo", agg="token-mean", dual_clip=None, mismatch=mode, mismatch_cap=2.0)
    loss, _ = policy_loss(logp, OLD, adv, MASK, opts, rollout_logprobs=ROLLOUT)
    loss.backward()
    rows, _ = EXPECTED[mode]
    w = torch.tensor([rows[0], rows[1] + [0.0]], dtype=torch.float64)
    assert loss.item() == pytest.approx((-(adv[:, None] * w).sum() / 5).item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, -adv[:, None] * w / 5, rtol=1e-12, atol=0)


def test_tis_cap_is_token_tis():
    logp = OLD.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    a, _ = policy_loss(
        logp, OLD, adv, MASK, LossOptions(algorithm="grpo", tis_cap=2.0), rollout_logprobs=ROLLOUT
    )
    b, _ = policy_loss(
        logp,
        OLD,
        adv,
        MASK,
        LossOptions(algorithm="grpo", mismatch="token_tis", mismatch_cap=2.0),
        rollout_logprobs=ROLLOUT,
    )
    assert a.item() == b.item()


def test_stats_hand_computed():
    s = mismatch_stats(OLD, ROLLOUT, MASK)
    logs = sorted([math.log(1.8), math.log(0.25), math.log(1.5), 0.0, math.log(3.0)])
    assert s["mismatch/log_ratio_mean"] == pytest.approx(sum(logs) / 5, rel=1e-12)
    assert s["mismatch/log_ratio_abs_mean"] == pytest.approx(sum(map(abs, logs)) / 5, rel=1e-12)
    # Linear interpolation at q (n - 1) = 0.04, 2 and 3.96 on the sorted values.
    assert s["mismatch/log_ratio_p01"] == pytest.approx(logs[0] + 0.04 * (logs[1] - logs[0]), rel=1e-12)
    assert s["mismatch/log_ratio_p50"] == pytest.approx(math.log(1.5), rel=1e-12)
    assert s["mismatch/log_ratio_p99"] == pytest.approx(logs[3] + 0.96 * (logs[4] - logs[3]), rel=1e-12)
    assert mismatch_stats(OLD, ROLLOUT, torch.zeros_like(MASK)) == {}


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(mismatch="seq"),
            "mismatch must be one of none, token_tis, seq_tis, token_mis, seq_mis, icepop",
        ),
        (dict(mismatch="icepop", mismatch_cap=0.5), "mismatch_cap must be >= 1"),
        (dict(mismatch="icepop", tis_cap=2.0), "cannot be combined"),
    ],
)
def test_bad_options(kw, message):
    with pytest.raises(ValueError, match=message):
        LossOptions(**kw)


def test_needs_rollout_logprobs():
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        policy_loss(OLD, OLD, torch.ones(2), MASK, LossOptions(mismatch="seq_mis"))
