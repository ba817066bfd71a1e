"""The engine side of the bucketed GPU sync, run without a GPU: the same extension methods in the same
order as ``bandpo.weight_sync.ipc.send_ipc`` (begin, one ``load_weights`` per bucket, finish), each
bucket in a /dev/shm file where the GPU hands a CUDA IPC buffer. Not a transport of the trainer (on
CPU it syncs through one ``reload_weights``, ``rollout.weight_sync=shm``): what lets CPU tests run
vLLM's layerwise bucketed reload, and its engine core in its own process, as a GPU run does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

from bandpo.flat_buffer import metas_to_wire
from bandpo.shm.weight_files import remove_shm, write_weights_shm


def send_shm_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], update: Callable[[str, object], object], path: str
) -> int:
    """Load ``buckets`` into an engine through ``update(op, payload)`` (``VllmEngine.ipc_update``, or a
    Ray call of it): "begin", then per bucket its file at ``path`` (rewritten in place: ``update``
    returns once every worker has loaded it) and "load_shm", then "finish", also after a failure (the
    first error is the one raised). The file is removed at the end. Returns the bucket count."""
    count = 0
    update("begin", None)
    try:
        for bucket in buckets:
            metas = write_weights_shm(bucket, path)
            update("load_shm", (path, metas_to_wire(metas)))
            count += 1
    except BaseException as e:
        try:
            update("finish", None)
        except Exception as done:
            e.add_note(f"finishing the engine's bucketed update failed too: {done}")
        raise
    finally:
        if os.path.exists(path):
            remove_shm(path)
    update("finish", None)
    return count
