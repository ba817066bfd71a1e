"""The actor's optimizer (``bandpo.actor.setup.adamw``, torch's fused kernel) against AdamW written out
(Loshchilov & Hutter, decoupled weight decay; torch's bias-corrected form)."""

from __future__ import annotations

import torch

from bandpo.actor.setup import adamw


def _by_hand(w, grads, lr, betas, wd, eps=1e-8):
    b1, b2 = betas
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        w = w - lr * m_hat / (v_hat.sqrt() + eps)
    return w


def test_fused_adamw_equals_the_update_written_out():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(10_000, generator=gen, dtype=torch.float64).float()
    # gradients over six decades, so both the eps-dominated and the normal regime are stepped
    grads = [torch.randn(10_000, generator=gen) * torch.logspace(-9, -3, 10_000) for _ in range(3)]
    lr, betas, wd = 1e-3, (0.9, 0.999), 0.01
    p = torch.nn.Parameter(w0.clone())
    opt = adamw([p], lr, betas, wd)
    assert opt.defaults["fused"]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _by_hand(w0.double(), [g.double() for g in grads], lr, betas, wd)
    # the reference in float64; fp32's rounding of w (|w| ~ 1: ~6e-8) and of the step (< lr) bounds
    # the gap at a few 1e-7; a wrong bias correction or weight decay moves entries by ~lr
    assert (p.detach().double() - want).abs().max().item() < 1e-6
    assert (p.detach().double() - w0.double()).abs().max().item() > 1e-3  # it did move, by ~lr per step
