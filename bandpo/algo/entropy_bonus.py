"""Entropy options on top of any surrogate: the high-entropy token selection and the adaptive entropy
bonus, with the table of the surrogates each combines with (``COMBINABLE_OPTIONS``).

Top-entropy selection (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
Effective Reinforcement Learning for LLM Reasoning", arXiv 2506.01939): the policy loss keeps only the
tokens in the top rho fraction by the current policy's entropy H_t, per micro-batch:

    tau  = quantile_{1 - rho}( {H_t : t valid} )      (linear interpolation: torch.quantile)
    keep = valid & (H_t >= tau)                        (ties at tau are kept)
    L_t <- keep_t L_t                                  (the aggregation's normalisers are unchanged)

Both the quantile and the comparison are made in float32 (H_t cast to float32), so the token at the
quantile is always kept and rho = 0 keeps the highest-entropy token(s). TRL's ``get_high_entropy_mask``
computes tau in float32 the same way but compares at the entropies' own precision: equal for float32
entropies (the actor's), while for float64 ones TRL drops a token whose value lies below its own float32
rounding of tau (and for bfloat16 ones compares with tau rounded to bfloat16). The paper's rho is 0.2;
rho = 1 keeps every token (off). The entropy bonus, when on, acts on the kept tokens only. With several
actor ranks each rank's micro-batch has its own tau (TRL gathers the ranks' entropies first).

Adaptive entropy bonus (Skywork-OR1, arXiv 2505.22312; TRL's ``use_adaptive_entropy``): the bonus
coefficient c moves toward keeping the measured entropy H at or above a target H*:

    applied c_k   = c_k if H_{k-1} <= H* else 0               (no measurement yet: 0)
    c_{k+1}       = min(c_k + d, c_max) if H_k <= H* else max(c_k - d, c_min)

H_k is the current policy's mean token entropy over the tokens the bonus acts on, measured during step
k's update; c_0 is ``entropy_coef``; TRL's defaults d = 0.005, c_min = 0, c_max = 1. The functions are
pure; the trainer carries (c, H) from step to step (``EntropyController``) and saves them in its
checkpoints. TRL updates c once per optimizer step; here once per training step (the same with one
optimizer step per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bandpo.errors import check_number

# TRL's defaults for the adaptive control (GRPOConfig: entropy_coef_delta, entropy_coef_min, entropy_coef_max).
COEF_DELTA = 0.005
COEF_MIN = 0.0
COEF_MAX = 1.0

# Options on top of the surrogate -> {algorithm: why it does not combine}; an algorithm not named combines.
COMBINABLE_OPTIONS: dict[str, dict[str, str]] = {
    "top_entropy_quantile": {
        "gspo": "gspo's ratio and clip are per sequence, over all its tokens: dropping some tokens' loss "
        "would leave them in the ratio that decides the others' clip",
    },
    "entropy_control": {},
}


def check_combinable(algorithm: str, option: str, name: str | None = None) -> None:
    """Refuse ``option`` (a key of ``COMBINABLE_OPTIONS``, shown as ``name``) for an algorithm it does not
    combine with, saying why."""
    if option not in COMBINABLE_OPTIONS:
        raise ValueError(f"unknown option {option!r}; valid: {', '.join(COMBINABLE_OPTIONS)}")
    why = COMBINABLE_OPTIONS[option].get(algorithm)
    if why is not None:
        raise ValueError(f"{name or option} does not combine with algorithm={algorithm} ({why})")


def check_quantile(rho, name: str = "top_entropy_quantile") -> None:
    """rho in [0, 1]: 1 keeps every token, 0 the highest-entropy ones only."""
    check_number(rho, name, low=0, high=1)


def top_entropy_mask(entropy: torch.Tensor, maskf: torch.Tensor, rho: float) -> torch.Tensor:
    """``keep`` (module docstring): boolean [N, R], the valid tokens whose entropy ``entropy`` [N, R] is
    in the top ``rho`` fraction of the valid tokens'; all False when none is valid."""
    valid = maskf.bool()
    with torch.no_grad():
        h = entropy.detach().float()  # [N, R]
        values = h[valid]  # [n_valid]
        if values.numel() == 0:
            return torch.zeros_like(valid)
        tau = torch.quantile(values, 1.0 - rho)
        return (h >= tau) & valid


@dataclass(frozen=True)
class EntropyControl:
    """The adaptive bonus' settings (module docstring): target entropy H* in nats, step d, bounds of c."""

    target: float
    delta: float = COEF_DELTA
    coef_min: float = COEF_MIN
    coef_max: float = COEF_MAX

    def __post_init__(self):
        check_number(self.target, "entropy_target", low=0)
        check_number(self.delta, "entropy_coef_delta", low=0, strict_low=True)
        check_number(self.coef_min, "entropy_coef_min", low=0)
        check_number(self.coef_max, "entropy_coef_max", low=self.coef_min)


def applied_coef(coef: float, last_entropy: float | None, control: EntropyControl) -> float:
    """The coefficient a step applies: ``coef`` when the last measured entropy is at or below the target,
    else 0 (``last_entropy`` None: no measurement yet, 0)."""
    return coef if last_entropy is not None and last_entropy <= control.target else 0.0


def next_coef(coef: float, measured: float, control: EntropyControl) -> float:
    """The next step's coefficient after a step that measured entropy ``measured``."""
    if not math.isfinite(measured):
        raise ValueError(f"entropy control: the measured entropy must be finite, got {measured!r}")
    if measured <= control.target:
        return min(coef + control.delta, control.coef_max)
    return max(coef - control.delta, control.coef_min)


def measured_entropy(metrics: dict[str, float]) -> float:
    """The entropy the control reads from an update's metrics: the mean over the tokens the bonus acts on
    (``top_entropy/entropy`` with the top-entropy selection, else ``entropy``)."""
    key = "top_entropy/entropy" if "top_entropy/entropy" in metrics else "entropy"
    if key not in metrics:
        raise ValueError(f"entropy control: the update's metrics have no {key!r}")
    return float(metrics[key])


class EntropyController:
    """The trainer's state of the adaptive bonus: the coefficient c and the last measured entropy."""

    def __init__(self, control: EntropyControl, coef: float):
        self.control = control
        self.coef = float(coef)
        self.last_entropy: float | None = None
        self.applied = 0.0

    def step_coef(self) -> float:
        """The coefficient this step applies (remembered for ``observe``'s metrics)."""
        self.applied = applied_coef(self.coef, self.last_entropy, self.control)
        return self.applied

    def observe(self, update_metrics: dict[str, float]) -> dict[str, float]:
        """After the step's update: measure, move c; returns the step's ``entropy_bonus/*`` metrics."""
        measured = measured_entropy(update_metrics)
        self.coef = next_coef(self.coef, measured, self.control)
        self.last_entropy = measured
        return {
            "entropy_bonus/applied_coef": self.applied,
            "entropy_bonus/next_coef": self.coef,
            "entropy_bonus/measured": measured,
            "entropy_bonus/target": self.control.target,
        }

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict | None, where: str) -> None:
        """Restore from a checkpoint's trainer state; a checkpoint without it is an error naming ``where``."""
        if not isinstance(state, dict) or "coef" not in state or "last_entropy" not in state:
            raise ValueError(
                f"{where}: no entropy_control state (coef, last_entropy), but algorithm.entropy_target is set; "
                "the checkpoint was written by a run without the adaptive entropy bonus"
            )
        self.coef = float(state["coef"])
        self.last_entropy = None if state["last_entropy"] is None else float(state["last_entropy"])


def entropy_controller(options) -> EntropyController | None:
    """The trainer's controller for ``options`` (a ``LossOptions``): None without ``entropy_control``,
    else one starting at ``entropy_coef``."""
    if options.entropy_control is None:
        return None
    return EntropyController(options.entropy_control, options.entropy_coef)
