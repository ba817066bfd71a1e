"""Reading one key of the typed config for validation, and the checks that name the key and the
value they refuse. A rule written next to its mechanism (a ``check_*`` raising ``ValueError``) runs
through ``_rule``, which re-raises its message as a ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bandpo.errors import ConfigError, check, check_choice, check_number


def _get(cfg, key: str) -> Any:
    """The value at dotted ``key`` of the typed config (``bandpo.config.schema``): every key exists there
    (the schema refused unknown ones); a section that is null (``algorithm.band`` of another algorithm)
    gives None for its keys."""
    node = cfg
    for part in key.split("."):
        if node is None:
            return None
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


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
