"""Reading one config key for validation: its value (a ``???`` or a broken interpolation is an error
naming the key), and the checks that name the key and the value they refuse. A rule written next
to its mechanism (a ``check_*`` raising ``ValueError``) runs through ``_rule``, which re-raises its
message as a ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bandpo.errors import ConfigError, check, check_choice, check_number


def _get(cfg, key: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except MissingMandatoryValue:
        raise ConfigError(f"config error: {key} is required (it is ???); set it with {key}=...") from None
    except Exception as e:  # interpolation errors name the bad reference
        raise ConfigError(f"config error: {key}: {e}") from None
    return value


def _check(cond: bool, key: str, msg: str, value: Any) -> None:
    check(cond, key, msg, repr(value))  # the config's messages show the value's repr


def _rule(rule, *args, **kwargs) -> Any:
    """``rule(*args, **kwargs)``: a validation rule written once, next to the mechanism it protects, called
    with the config key as the name it gives the value; its ``ValueError`` is re-raised as a ``ConfigError``."""
    try:
        return rule(*args, **kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None


def _choice(cfg, key: str, valid: Sequence[str]) -> Any:
    value = _get(cfg, key)
    _rule(check_choice, value, valid, key)
    return value


def _number(
    cfg,
    key: str,
    *,
    low: float | None = None,
    high: float | None = None,
    strict_low: bool = False,
    integer: bool = False,
) -> float:
    value = _get(cfg, key)
    _rule(check_number, value, key, low=low, high=high, strict_low=strict_low, integer=integer)
    return value
