"""Clip fractions by old-probability bin, split by sign (``clip_frac_bin_up/`` and ``clip_frac_bin_down/``),
for every surrogate on one hand-built batch, and their reduction over micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.actor.loss_metrics import MetricAccumulator
from bandpo.algo import LossOptions, policy_loss
from bandpo.algo.losses import PROB_BIN_NAMES

# One column per old-probability bin: p = 0.005 (lt0.01), 0.05 (0.01-0.1), 0.25 (0.1-0.5), 0.8 (ge0.5).
OLD_P = [0.005, 0.05, 0.25, 0.8]
# Row 0: A = +1; row 1: A = -1; row 2: A = +1 with its last two positions padding (ratio 5 there, which
# would be cut if it counted). Tokens per bin: 3, 3, 2, 2 (10 valid).
RATIOS = [[2.0, 1.5, 1.7, 1.15], [0.4, 0.7, 0.9, 0.75], [1.0, 1.3, 5.0, 5.0]]
ADV = torch.tensor([1.0, -1.0, 1.0])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])

# The bounds at these p (bandpo KL delta 0.05 from bandpo.algo.band, dcpo from its closed form):
#   p      grpo        clip_higher   bandpo            dcpo (0.16/0.20, cap 10)
#   0.005  [0.8, 1.2]  [0.8, 1.28]   [1.7e-5, 13.19]   [0.5, 6.84]
#   0.05                             [0.162, 2.98]     [0.5, 2.56]
#   0.25                             [0.528, 1.601]    [0.5, 1.525]
#   0.8                              [0.821, 1.131]    [0.724, 1.207]
# A token is cut up where A > 0 and r > upper, down where A < 0 and r < lower; every ratio is at least
# 0.019 from the bound it is tested against, so float rounding cannot move a token across it.
#   grpo:        up   (0,0) 2.0, (0,1) 1.5, (0,2) 1.7, (2,1) 1.3;   down (1,0) 0.4, (1,1) 0.7, (1,3) 0.75
#   clip_higher: as grpo (1.3 > 1.28 still; 1.15 < 1.28)
#   bandpo:      up   (0,2) 1.7 > 1.601, (0,3) 1.15 > 1.131;         down (1,3) 0.75 < 0.821
#   dcpo:        up   (0,2) 1.7 > 1.525;                             down (1,0) 0.4 < 0.5
# DPPO-TV cuts where p - p_old passes 0.15 (up, A > 0) or -0.15 (down, A < 0): (0,2) 0.425 - 0.25 = 0.175
# up, (1,3) 0.6 - 0.8 = -0.2 down; the rest move by at most 0.12.
# GSPO clips whole sequences on the geometric-mean ratio (eps 3e-4 / 4e-4): row 0 (mean > 1, A > 0) up,
# row 1 (mean < 1, A < 0) down, row 2 (sqrt(1.3) over its valid tokens, A > 0) up.
# CISPO marks the clipped weights of tokens with A != 0 whatever the sign, r > 1.28 as up (no lower
# bound: eps_low = 1): the ratios 2.0, 1.5, 1.7 and 1.3. SAPO's soft gate cuts nothing.
# Fractions of each bin's tokens (3, 3, 2, 2), in bin order lt0.01, 0.01-0.1, 0.1-0.5, ge0.5:
EXPECTED = {
    "grpo": ([1 / 3, 2 / 3, 1 / 2, 0], [1 / 3, 1 / 3, 0, 1 / 2]),
    "clip_higher": ([1 / 3, 2 / 3, 1 / 2, 0], [1 / 3, 1 / 3, 0, 1 / 2]),
    "bandpo": ([0, 0, 1 / 2, 1 / 2], [0, 0, 0, 1 / 2]),
    "dcpo": ([0, 0, 1 / 2, 0], [1 / 3, 0, 0, 0]),
    "dppo_tv": ([0, 0, 1 / 2, 0], [0, 0, 0, 1 / 2]),
    "gspo": ([2 / 3, 2 / 3, 1 / 2, 1 / 2], [1 / 3, 1 / 3, 1 / 2, 1 / 2]),
    "cispo": ([1 / 3, 2 / 3, 1 / 2, 0], [0, 0, 0, 0]),
    "sapo": ([0, 0, 0, 0], [0, 0, 0, 0]),
}
TOKENS_IN_BIN = [3, 3, 2, 2]
# Each metric is a ratio of two small integer counts computed in float32: one rounding, ~6e-8 relative.
TOL = 1e-6


def _batch(rows=slice(None)):
    old = torch.tensor([OLD_P] * 3, dtype=torch.float64).log()
    logp = old + torch.tensor(RATIOS, dtype=torch.float64).log()
    return logp[rows], old[rows], ADV[rows], MASK[rows]


def _options(algorithm):
    # Every ratio with A < 0 is below 1, so the clipped family's dual clip (c = 10) never binds here;
    # the rivals refuse it.
    clipped = algorithm in ("grpo", "clip_higher", "bandpo", "dcpo")
    return LossOptions(algorithm=algorithm, dual_clip=10.0 if clipped else None)


def _bins(metrics, prefix):
    return [float(metrics[f"{prefix}/{name}"]) for name in PROB_BIN_NAMES]


@pytest.mark.parametrize("algorithm", list(EXPECTED))
def test_signed_bins_are_the_hand_counted_fractions(algorithm):
    logp, old, adv, mask = _batch()
    _, m = policy_loss(logp, old, adv, mask, _options(algorithm))
    up, down = EXPECTED[algorithm]
    assert _bins(m, "clip_frac_bin_up") == pytest.approx(up, abs=TOL)
    assert _bins(m, "clip_frac_bin_down") == pytest.approx(down, abs=TOL)
    # The unsigned bins are their sum (up and down are disjoint), as before the split.
    assert _bins(m, "clip_frac_bin") == pytest.approx([u + d for u, d in zip(up, down)], abs=TOL)
    assert _bins(m, "token_frac_bin") == pytest.approx([n / 10 for n in TOKENS_IN_BIN], abs=TOL)
    # The totals are fractions of all 10 valid tokens: the bins weighted by their token counts.
    n_up = sum(u * n for u, n in zip(up, TOKENS_IN_BIN))
    n_down = sum(d * n for d, n in zip(down, TOKENS_IN_BIN))
    assert float(m["clip_frac_up"]) == pytest.approx(n_up / 10, abs=TOL)
    assert float(m["clip_frac_down"]) == pytest.approx(n_down / 10, abs=TOL)


def test_dual_clip_is_in_no_signed_bin():
    # A = -1 at r = 12 > c = 10: the dual clip removes the gradient, but the ratio is above the lower
    # bound, so it is no down-clip; it is counted in clip_frac_dual alone.
    old = torch.full((1, 1), math.log(0.5), dtype=torch.float64)
    _, m = policy_loss(old + math.log(12.0), old, torch.tensor([-1.0]), torch.ones(1, 1), _options("grpo"))
    assert float(m["clip_frac_dual"]) == 1.0
    assert float(m["clip_frac_bin_up/ge0.5"]) == float(m["clip_frac_bin_down/ge0.5"]) == 0.0


@pytest.mark.parametrize("algorithm", ["grpo", "bandpo"])
def test_micro_batches_reduce_to_the_full_batch(algorithm):
    """The actor weights a per-bin fraction by the micro-batch's tokens in that bin, so two micro-batches
    (rows 0-1: 8 tokens, 2 per bin; row 2: 2 tokens, both in the lower two bins) give the full batch's
    fractions; weighting by all tokens would give grpo's up-clips below p = 0.01 as (8 * 1/2 + 2 * 0) / 10
    = 0.4 instead of 1/3."""
    acc = MetricAccumulator()
    for rows in (slice(0, 2), slice(2, 3)):
        logp, old, adv, mask = _batch(rows)
        _, m = policy_loss(logp, old, adv, mask, _options(algorithm))
        acc.add_micro(m, mask.sum())
    out = acc.reduce(lambda v: v)
    up, down = EXPECTED[algorithm]
    assert [out[f"clip_frac_bin_up/{b}"] for b in PROB_BIN_NAMES] == pytest.approx(up, abs=TOL)
    assert [out[f"clip_frac_bin_down/{b}"] for b in PROB_BIN_NAMES] == pytest.approx(down, abs=TOL)
    assert [out[f"clip_frac_bin/{b}"] for b in PROB_BIN_NAMES] == pytest.approx(
        [u + d for u, d in zip(up, down)], abs=TOL
    )
