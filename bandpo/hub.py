"""Datasets and models given by Hugging Face hub id: one-line errors when they cannot be loaded.

Machines without Hub access use the Hub libraries' own offline mode: with ``HF_HUB_OFFLINE=1``
(models and datasets) or ``HF_DATASETS_OFFLINE=1`` (datasets), ``datasets.load_dataset`` and
``from_pretrained`` read the local cache (``HF_HOME``) and never try the network. Nothing here
sets those variables or passes a cache folder of its own, so a warm cache is what they read.
A hub input that is neither reachable nor cached becomes ``HubUnreachable``, naming it, its hub
id and why; the caller adds the config key that takes a local copy instead.
"""

from __future__ import annotations

import os

from bandpo.errors import HubUnreachable, InputError

MODEL_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # what from_pretrained reads
DATASET_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # what datasets.load_dataset reads
_TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub and datasets read as true


def offline_vars(names: tuple[str, ...]) -> list[str]:
    """Those of the offline-mode variables ``names`` set to a true value in this process's environment."""
    return [k for k in names if os.environ.get(k, "").strip().upper() in _TRUE]


def first_line(err: BaseException, limit: int = 240) -> str:
    """``err``'s message on one line (its lines joined), cut at ``limit`` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_unreachable(err: BaseException) -> bool:
    """True when ``err``, or an exception it came from, says the Hub could not be reached and the
    cache did not hold the files (no route, a timeout, offline mode with a cold cache)."""
    import httpx
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    kinds = (
        ConnectionError,
        TimeoutError,
        httpx.TransportError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
    )
    try:  # recent huggingface_hub releases make their requests with httpx2, whose errors are its own classes
        import httpx2

        kinds += (httpx2.TransportError,)
    except ImportError:
        pass
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, kinds):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return False


def hub_error(what: str, err: BaseException, offline_env: tuple[str, ...] = MODEL_OFFLINE_ENV) -> InputError:
    """The one-line error for ``what`` (e.g. "dataset amc23 (hub id math-ai/amc23)") failing to load with
    ``err``: ``HubUnreachable`` for a connection or cache miss (naming those of ``offline_env`` that
    are set), else ``InputError`` with the library's reason."""
    if not is_unreachable(err):
        return InputError(f"{what} cannot be loaded: {first_line(err)}")
    from huggingface_hub import constants

    flags = offline_vars(offline_env)
    if flags:
        why = (
            f"offline mode is on ({', '.join(f'{k}={os.environ[k]}' for k in flags)}) and it is not in the "
            f"Hugging Face cache ({constants.HF_HOME})"
        )
    else:
        why = (
            f"the Hub cannot be reached ({first_line(err)}) and it is not in the Hugging Face cache "
            f"({constants.HF_HOME}; HF_HUB_OFFLINE=1 reads a warm one without trying the network)"
        )
    return HubUnreachable(f"{what} cannot be loaded: {why}")


def keyed(err: InputError, key: str, local: str) -> InputError:
    """``err`` prefixed with the config ``key``; a ``HubUnreachable`` also says how to give a local copy (``local``)."""
    if isinstance(err, HubUnreachable):
        return HubUnreachable(f"{key}: {err}; give a local copy with {local}")
    return type(err)(f"{key}: {err}")


def load_tokenizer(path: str, key: str):
    """``AutoTokenizer.from_pretrained(path)`` (a folder or a hub id); failing, an ``InputError`` naming ``key``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    # OSError: not found / unreachable; ValueError: a folder it cannot parse
    except (OSError, ValueError) as e:
        what = f"model {path}" if os.path.isdir(path) else f"model {path} (hub id)"
        local = f"{key}=<local folder> (e.g. from `hf download {path} --local-dir <folder>` where the Hub is reachable)"
        raise keyed(hub_error(what, e), key, local) from e
