"""Reading checkpoint files without running code: every ``.pt`` file bandpo reads is loaded with
``torch.load(weights_only=True)``.

A ``.pt`` file is a pickle, and unpickling it with ``weights_only=False`` calls whatever function
the file names: a checkpoint someone shared (``scripts/eval.sh checkpoint=...``, a resumed run
copied from elsewhere) could run any command. With ``weights_only=True`` torch rebuilds only
tensors, plain containers and scalars, plus the classes a caller allow-lists; a file naming
anything else is refused here with ``UnsafeCheckpoint``, naming the file and what it names.

bandpo's own files hold only tensors and plain data, or (``in_flight.pt``) the dataclasses its
reader allow-lists. DeepSpeed reads its own shard files itself (``engine.load_checkpoint``,
``zero_to_fp32``), and its calls pass ``weights_only=False``: ``weights_only_loads`` overrides that
for the duration, with the few DeepSpeed classes its ZeRO files hold (``deepspeed_globals``) allowed.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bandpo.errors import UnsafeCheckpoint

# torch reads it at every torch.load and then loads with weights_only=True whatever the call passes.
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
# The variable is process-wide: one weights_only_loads block at a time, so none ends another's override
# (re-entrant for a block inside a block). Loads in other threads meanwhile are only held stricter.
_FORCING = threading.RLock()


# The DeepSpeed classes its ZeRO-2/3 checkpoint files pickle (DeepSpeed 0.19: found with
# torch.serialization.get_unsafe_globals_in_checkpoint on files it wrote; its model-state files hold
# none), and why each may be rebuilt: plain data holders whose unpickling runs no code of the file's choosing.
DEEPSPEED_GLOBALS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "optimizer states' loss_scaler: the static loss scale (1.0 in fp32 and bf16, bandpo's dtypes)",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "optimizer states' zero_stage: an int enum",
    "deepspeed.utils.tensor_fragment.fragment_address": "ZeRO-2 optimizer states' param_slice_mappings: each parameter's (numel, start) in its partition",
}


def deepspeed_globals() -> list:
    """The classes ``DEEPSPEED_GLOBALS`` names (imports DeepSpeed)."""
    import importlib

    out = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def load(file: str | os.PathLike, allowed: Sequence[Any] = (), **kwargs) -> Any:
    """``torch.load(file, weights_only=True, **kwargs)`` with ``allowed`` classes besides torch's own.

    A file that names other globals raises ``UnsafeCheckpoint`` (nothing of it has run); other
    errors (a truncated file) pass through for the caller to report.
    """
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(refusal(file, unsafe_globals(file, allowed) or [_reason(e)])) from None


def unsafe_globals(
    file: str | os.PathLike, allowed: Sequence[Any] = (), names: Iterable[str] = ()
) -> list[str]:
    """The globals ``file``'s pickle names beyond torch's safe ones, ``allowed`` (classes) and ``names``
    (their ``module.qualname``, for a check that need not import them), read without unpickling.
    Empty also when the file is no zip ``torch.save`` file (legacy format, truncated): loading it
    then tells what is wrong."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            found = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except (ValueError, RuntimeError):
        return []
    return sorted(set(found) - set(names))


def refusal(file: str | os.PathLike, names: Sequence[str]) -> str:
    """The one line ``UnsafeCheckpoint`` says for ``file`` naming ``names``."""
    return (
        f"unsafe checkpoint: {file} holds pickled code ({', '.join(names)}) that loading would run; "
        f"bandpo refuses to run it (checkpoint files may hold only tensors and plain data)"
    )


def check_folder(folder: str | os.PathLike, allowed: Sequence[Any] = (), names: Iterable[str] = ()) -> None:
    """Raise ``UnsafeCheckpoint`` for the first ``.pt`` file under ``folder`` (sorted) whose pickle names
    globals beyond torch's, ``allowed`` and ``names`` (see ``unsafe_globals``). Cheap: only the
    pickles are read, no tensor data."""
    for file in sorted(Path(folder).rglob("*.pt")):
        found = unsafe_globals(file, allowed, names)
        if found:
            raise UnsafeCheckpoint(refusal(file, found))


@contextmanager
def weights_only_loads(folder: str | os.PathLike, allowed: Sequence[Any] = ()) -> Iterator[None]:
    """Every ``torch.load`` inside loads with ``weights_only=True`` (``allowed`` added to torch's safe
    classes), whatever the caller passes: for DeepSpeed's loaders, which pass ``weights_only=False``.

    ``folder`` (the files they will read) is checked first, so a file holding code is refused by
    name before any is read; should a load still refuse one (a pickle that hides its globals from
    that check), ``UnsafeCheckpoint`` names ``folder`` and torch's reason.
    """
    import torch

    check_folder(folder, allowed)
    with _FORCING:
        previous = os.environ.get(FORCE_WEIGHTS_ONLY)
        os.environ[FORCE_WEIGHTS_ONLY] = "1"
        try:
            with torch.serialization.safe_globals(list(allowed)):
                yield
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(refusal(f"a file under {folder}", [f"torch: {_reason(e)}"])) from None
        finally:
            if previous is None:
                os.environ.pop(FORCE_WEIGHTS_ONLY, None)
            else:
                os.environ[FORCE_WEIGHTS_ONLY] = previous


def _reason(error: pickle.UnpicklingError) -> str:
    """The unpickler's own line out of torch's multi-paragraph weights_only message."""
    text = str(error).split("\n\nCheck the documentation")[0]
    text = text.split("WeightsUnpickler error: ")[-1]
    lines = [line.strip() for line in text.strip().split("\n\n")[-1].splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(error).__name__
