"""Reduction of per-micro-batch loss metrics to one number per metric for the whole update.

``policy_loss`` returns, per micro-batch, fractions/means over that micro-batch's valid
tokens, and ``loss``/``pg_loss`` already normalised by the global mini-batch counts. So:
- ``loss``, ``pg_loss``: summed over micro-batches and ranks (= the mini-batch loss), then
  averaged over optimizer steps;
- ``clip_frac_bin/<bin>``, ``clip_frac_bin_up/<bin>``, ``clip_frac_bin_down/<bin>``: weighted by the
  valid tokens *in that bin* (fractions of the bin's tokens);
- ``top_entropy/entropy`` (a mean over the kept tokens): weighted by the kept tokens;
- every other metric: weighted by valid tokens.
The result is the exact global value, the same on every rank, with one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SUMMED = ("loss", "pg_loss")
# Per-bin fractions of the bin's own tokens (``bandpo.algo.losses._clip_metrics``).
PER_BIN = ("clip_frac_bin/", "clip_frac_bin_up/", "clip_frac_bin_down/")
# Means over a share of the valid tokens -> the metric of that share (``bandpo.algo.losses.policy_loss``).
WEIGHTED_BY = {"top_entropy/entropy": "top_entropy/kept_frac"}


class MetricAccumulator:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.tokens = torch.zeros((), dtype=torch.float64)
        self.grad_norms: list[float] = []
        self.lr = math.nan
        self.steps = 0
        self.nonfinite_steps = 0

    def add_micro(self, metrics: dict[str, torch.Tensor], n_tokens: torch.Tensor) -> None:
        """Add one micro-batch's ``policy_loss`` metrics; ``n_tokens`` is its valid-token count."""
        n = n_tokens.detach().to("cpu", torch.float64)
        for key, value in metrics.items():
            value = value.detach().to("cpu", torch.float64)
            if key in SUMMED:
                weight = torch.ones((), dtype=torch.float64)
            elif key in WEIGHTED_BY:  # a mean over a share of the valid tokens: weighted by that share
                weight = n * metrics[WEIGHTED_BY[key]].detach().to("cpu", torch.float64)
            elif key.startswith(PER_BIN):
                weight = n * metrics["token_frac_bin/" + key.split("/", 1)[1]].detach().to(
                    "cpu", torch.float64
                )
            else:
                weight = n
            self.sums[key] = self.sums.get(key, 0.0) + value * weight
            self.weights[key] = self.weights.get(key, 0.0) + weight
        self.tokens = self.tokens + n

    def add_step(self, grad_norm, lr: float, nonfinite: bool = False) -> None:
        """Record one optimizer step: its global grad norm (tensor, float or None), learning rate,
        and whether it was discarded for a NaN/inf loss or gradient."""
        if grad_norm is not None:
            self.grad_norms.append(float(grad_norm))
        self.lr = float(lr)
        self.steps += 1
        self.nonfinite_steps += bool(nonfinite)

    def reduce(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Global metrics; ``all_reduce`` sums a float64 CPU vector over ranks (identity for one rank)."""
        keys = sorted(self.sums)
        k = len(keys)
        vec = torch.stack(
            [self.sums[key] for key in keys] + [self.weights[key] for key in keys] + [self.tokens]
        )
        vec = all_reduce(vec).tolist()
        steps = max(self.steps, 1)
        out: dict[str, float] = {}
        for i, key in enumerate(keys):
            if key in SUMMED:
                out[key] = vec[i] / steps
            else:
                out[key] = vec[i] / vec[k + i] if vec[k + i] > 0 else 0.0
        out["num_tokens"] = vec[2 * k]
        out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else math.nan
        out["lr"] = self.lr
        out["optimizer_steps"] = float(self.steps)
        out["nonfinite_steps"] = float(self.nonfinite_steps)
        return out
