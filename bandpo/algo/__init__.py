"""Pure-torch algorithm core: Band operator, the registry of algorithms, policy losses, advantages.

Imports nothing heavier than torch (no ray, vllm or deepspeed): a test enforces it.
"""

from bandpo.algo.adaptive import ADAPTIVE_MODES, ENTROPY_NORMS, adaptive_delta, band_bounds_per_token
from bandpo.algo.advantages import compute_advantages, group_advantages
from bandpo.algo.band import DIVERGENCES, band_bounds
from bandpo.algo.dcpo import dac_bounds
from bandpo.algo.losses import aggregate, kl_penalty, policy_loss, ratio_interval
from bandpo.algo.mismatch import MISMATCH_MODES, mismatch_stats, mismatch_weights, tis_weights
from bandpo.algo.options import AGG_MODES, LossOptions
from bandpo.algo.registry import ALGORITHMS, get_algorithm

__all__ = [
    "ADAPTIVE_MODES",
    "AGG_MODES",
    "ALGORITHMS",
    "DIVERGENCES",
    "ENTROPY_NORMS",
    "LossOptions",
    "MISMATCH_MODES",
    "adaptive_delta",
    "aggregate",
    "band_bounds",
    "band_bounds_per_token",
    "compute_advantages",
    "dac_bounds",
    "get_algorithm",
    "group_advantages",
    "kl_penalty",
    "mismatch_stats",
    "mismatch_weights",
    "policy_loss",
    "ratio_interval",
    "tis_weights",
]
