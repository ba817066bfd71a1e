"""NCCL broadcast from actor rank 0 to every engine worker: the split layout's transport
(``rollout.weight_sync=nccl``, one node or many), on vLLM's weight-transfer engine.

The engines are built with ``weight_transfer_config={"backend": "nccl"}``
(``ENGINE_KWARGS``). At the first sync actor rank 0 opens a NCCL group of its own with every
engine worker (vLLM's stateless group over a TCP rendezvous on rank 0's node: rank 0 is the
actor, engine i's TP workers are ranks 1 + i * tp ..., independent of the actor's DeepSpeed
group). Per sync the engines start a layerwise reload, receive the metadata, and take part in
vLLM's packed broadcast (tensors packed into double-buffered ~1 GB GPU buffers) while rank 0
sends; then they finish the reload. The weights never pass through host memory.

Under ZeRO-3 every actor rank iterates the buckets (each bucket's gather is a collective);
only rank 0 sends. Under ZeRO-2 rank 0 holds the full weights and the other ranks return at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from bandpo.distributed.ports import free_port
from bandpo.flat_buffer import TensorMeta
from bandpo.weight_sync.waits import DEFAULT_TIMEOUT_S, ENGINE_HINT, NCCL_HINT, InThread, get_within

if TYPE_CHECKING:
    from ray.actor import ActorHandle

ENGINE_KWARGS = {"weight_transfer_config": {"backend": "nccl"}}  # vllm.LLM kwargs of an nccl-synced engine


def update_info(metas: Iterable[TensorMeta]) -> dict:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` as a plain dict: names, dtype names, shapes, in send order."""
    metas = list(metas)
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def worker_init_infos(address: str, port: int, engines: int, tp: int) -> list[dict]:
    """Per engine, the init info its workers join the group with: engine i's workers are ranks
    ``1 + i * tp + (TP rank)`` of ``1 + engines * tp`` (rank 0: the actor)."""
    world = 1 + engines * tp
    return [
        {
            "master_address": address,
            "master_port": port,
            "rank_offset": 1 + i * tp,
            "world_size": world,
            "packed": True,
        }
        for i in range(engines)
    ]


class NcclSender:
    """Actor rank 0's end of the broadcast group; made at the first sync, kept for the run.

    Every wait is bounded by ``timeout_s`` and names its stage (``bandpo.weight_sync.waits``): the
    rendezvous (both sides: rank 0's NCCL init runs in a thread, the engines' in their processes), the
    engines' start and finish of the reload, and the broadcast (rank 0's packing and sending in a
    thread while the engines' receives are waited for, so an engine that dies mid-broadcast ends it).
    """

    def __init__(self, engines: list[ActorHandle], tp: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import ray
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.engines, self.timeout_s = engines, timeout_s
        address, port = ray.util.get_node_ip_address(), free_port()
        self.hint = NCCL_HINT.format(address=address, port=port)
        infos = worker_init_infos(address, port, len(engines), tp)
        # a thread starts on device 0: CUDA's current device is per thread
        device = torch.cuda.current_device()

        def join() -> object:
            torch.cuda.set_device(device)
            return trainer_init(
                {"master_address": address, "master_port": port, "world_size": infos[0]["world_size"]}
            )

        # The workers block in the rendezvous until rank 0 joins, and rank 0 until they all have.
        refs = [e.weight_transfer.remote("init", info) for e, info in zip(engines, infos)]
        rank0 = InThread(join, "NCCL rendezvous (actor rank 0)")
        self.group = get_within(refs, timeout_s, "NCCL rendezvous", self.hint, alongside=rank0)[-1]

    def send(self, metas: list[TensorMeta], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast ``named_tensors`` (in ``metas``' order, CUDA) into every engine."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        get_within(
            [e.weight_transfer.remote("start") for e in self.engines],
            self.timeout_s,
            "the engines' start of a weight reload",
            ENGINE_HINT,
        )
        info = update_info(metas)
        receiving = [e.weight_transfer.remote("update", info) for e in self.engines]  # they wait in NCCL
        device = torch.cuda.current_device()

        def produce() -> None:
            # It drains every stream it broadcast on before it returns: the engines may read the buffers.
            torch.cuda.set_device(device)
            packed_nccl_broadcast_producer(
                iterator=iter(named_tensors), group=self.group, src=0, post_iter_func=lambda item: item[1]
            )

        sending = InThread(produce, "NCCL broadcast (actor rank 0)")
        get_within(receiving, self.timeout_s, "NCCL broadcast", self.hint, alongside=sending)
        get_within(
            [e.weight_transfer.remote("finish") for e in self.engines],
            self.timeout_s,
            "the engines' finish of a weight reload",
            ENGINE_HINT,
        )
