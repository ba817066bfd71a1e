"""Compose and validate the Hydra training config before any worker starts.

Every check names the config key it rejects, so a bad override fails in seconds with a
message like ``config error: algorithm.band.delta must be > 0, got -1``.
"""

from bandpo.config.algorithm import band_delta_range, loss_options
from bandpo.config.hydra_compose import CONFIG_DIR, check_override_keys, compose, to_plain
from bandpo.config.rules import reuse_old_logprobs, validate

__all__ = [
    "CONFIG_DIR",
    "band_delta_range",
    "check_override_keys",
    "compose",
    "loss_options",
    "reuse_old_logprobs",
    "to_plain",
    "validate",
]
