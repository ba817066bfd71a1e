"""The project's exception types, the config check that raises ``ConfigError``, and the generic value
checks the validation rules are written with (``check_number``, ``check_choice``).

A rule lives once, as a small function next to the mechanism it protects, raising ``ValueError`` that
names the value (its ``name`` argument) and shows it; ``bandpo.config.validate`` calls the same function
with the config key as the name and re-raises a ``ConfigError``.

Kept free of project imports so that any module (the light ``bandpo.algo`` / ``bandpo.reward`` included)
can raise or catch them without pulling in the module that usually raises them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config value is missing or invalid; the message names the key."""


class WorkerFailure(RuntimeError):
    """A worker process died or raised; the message names the worker group and the stage."""


class RankDeviceError(RuntimeError):
    """An actor rank computes on another device or precision than the plan gave it; one line naming the
    rank, its node and what it found (``bandpo.actor.setup.check_rank_device``)."""


class VerifierUnavailable(RuntimeError):
    """The reward pool's workers cannot start or run: nothing can be graded.

    An infrastructure fault, never a property of the responses; the message carries the
    cause reported by the worker (its traceback, or how it exited).
    """


class VerifierFailure(WorkerFailure):
    """A verifier actor kept dying or could not be (re)started."""


class PlacementError(RuntimeError):
    """The cluster cannot hold the plan's placement groups (names what is missing)."""


class InputError(ValueError):
    """A start-up input (a data file or row, a dataset, a model) cannot be read.

    The message names the input, the config key that chose it and the problem; the train and
    eval entry points print it as one line and exit 2.
    """


class HubUnreachable(InputError):
    """A dataset or model given by hub id is neither on a reachable Hub nor in the local cache."""


class UnsafeCheckpoint(InputError):
    """A checkpoint file's pickle names functions or classes beyond tensors and plain data: loading it
    would run code of the file's choosing, so bandpo refuses it unread (``bandpo.checkpoint.safe_load``).

    The message names the file and what its pickle names.
    """


class EvalUsageError(ValueError):
    """A mistake in the eval command's arguments; the message names it and what would be valid."""


def check(cond: bool, key: str, msg: str, shown: object) -> None:
    """Raise ``ConfigError("config error: <key> <msg>, got <shown>")`` unless ``cond``.

    ``shown`` goes into the message as ``str(shown)``: a caller that wants the value's repr
    passes ``repr(value)``, so each call site keeps the exact message its users see.
    """
    if not cond:
        raise ConfigError(f"config error: {key} {msg}, got {shown}")


def check_number(
    value: object,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    strict_low: bool = False,
    integer: bool = False,
) -> None:
    """Raise ``ValueError("<name> must be ..., got <repr(value)>")`` unless ``value`` is a finite number
    (an int with ``integer``; never a bool) with ``low <= value`` (``<`` with ``strict_low``) and
    ``value <= high``."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok_type or isinstance(value, bool):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and not (value > low if strict_low else value >= low):
        raise ValueError(f"{name} must be {'>' if strict_low else '>='} {low}, got {value!r}")
    if high is not None and not value <= high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")


def check_choice(value: object, valid: Iterable, name: str) -> None:
    """Raise ``ValueError("<name> must be one of <valid>, got <repr(value)>")`` unless ``value`` is in ``valid``."""
    valid = list(valid)
    if value not in valid:
        raise ValueError(f"{name} must be one of {', '.join(map(str, valid))}, got {value!r}")


class SharedMemoryFull(RuntimeError):
    """/dev/shm has too little free space for the weight sync (names its size, the bytes needed and the fix)."""


class WeightSyncTimeout(WorkerFailure):
    """A wait of the GPU weight sync ran past ``rollout.weight_sync_timeout``; names the stage and what to check."""


class StartupTimeout(WorkerFailure):
    """Actor ranks or engines still starting past ``trainer.startup_timeout``; names them and what to check."""
