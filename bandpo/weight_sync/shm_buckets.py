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
    buckets: Iterable[list[tuple[str, torch.Tensor]]], update: Callable[[str, object], object], prefix: str
) -> int:
    """Load ``buckets`` into an engine through ``update(op, payload)`` (``VllmEngine.ipc_update``, or a
    Ray call of it): "begin", then per bucket its own file ``<prefix>-<i>.bin`` and "load_shm", then
    "finish", also after a failure (the first error is the one raised). Returns the bucket count.

    Every file stays until "finish" has returned: vLLM's layerwise reload keeps the tensors it was given
    for a layer whose weights are not all in yet (a fused qkv_proj whose q came in one bucket and k, v
    in the next) and reads them only once the layer is complete. A file rewritten or shrunk meanwhile
    would hand it other weights, or kill the worker with SIGBUS.
    """
    paths: list[str] = []
    update("begin", None)
    try:
        for i, bucket in enumerate(buckets):
            paths.append(f"{prefix}-{i}.bin")
            metas = write_weights_shm(bucket, paths[-1])
            update("load_shm", (paths[-1], metas_to_wire(metas)))
    except BaseException as e:
        try:
            update("finish", None)
        except Exception as done:
            e.add_note(f"finishing the engine's bucketed update failed too: {done}")
        _remove(paths)
        raise
    try:
        update("finish", None)
    finally:
        _remove(paths)
    return len(paths)


def _remove(paths: list[str]) -> None:
    for path in paths:
        if os.path.exists(path):
            remove_shm(path)
