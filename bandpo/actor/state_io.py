"""The actor's weights going out: weight buckets for the rollout engines (shared memory, CUDA IPC,
NCCL) and their checksums. Checkpoints and the Hugging Face export, which read the same buckets, are
``bandpo.checkpoint.actor_state.ActorCheckpoints``'.

``ActorStateIO`` is a base of ``bandpo.actor.worker.Actor`` (Ray calls these methods on the actor)
and reads the actor's attributes: ``engine`` (DeepSpeed), ``rank``, ``world_size``, ``zero_stage``,
``on_cpu``, ``device``; the small collectives the actor's methods use (``_all_reduce``,
``_all_gather_object``, ``_barrier``) are here. Under ZeRO-3 every method that reads the full weights is
collective (each bucket is gathered on its own): all ranks must call it and iterate to the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from bandpo.actor.lora import SyncEntry, sync_entries
from bandpo.weight_sync.waits import DEFAULT_TIMEOUT_S


def iter_tensors(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten ``named_weights`` buckets into (name, tensor) pairs."""
    for bucket in buckets:
        yield from bucket


class ActorStateIO:
    """Weights for sync of one actor rank (see the module docstring)."""

    # ------------------------------------------------------------------ weights
    def named_weights(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters as (HF name, CPU tensor copy) lists of about ``bucket_bytes`` each.

        Tied weights appear once (``lm_head.weight`` is absent when tied to the embeddings).
        Under ZeRO-3 each bucket is gathered on its own (never the whole model): all ranks must
        iterate to the end.
        """
        for bucket in self.gathered_buckets(bucket_bytes):
            yield [(name, t.to("cpu", copy=True)) for name, t in bucket]

    def gathered_buckets(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters as (HF name, tensor on this rank's device) lists of about ``bucket_bytes``,
        no copy (with LoRA: the base model's names, each target's weight a new merged tensor,
        ``bandpo.actor.lora.sync_entries``): each list is valid only until the next is asked for (under ZeRO-3 its gather is
        released then). Collective under ZeRO-3: all ranks must iterate to the end. Names and
        order are ``weight_specs``'."""
        bucket: list[SyncEntry] = []
        size = 0
        for entry in sync_entries(self.engine.module):
            p = entry.param
            nbytes = getattr(p, "ds_numel", p.numel()) * p.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield from self._gathered_bucket(bucket)
                bucket, size = [], 0
            bucket.append(entry)
            size += nbytes
        if bucket:
            yield from self._gathered_bucket(bucket)

    def _gathered_bucket(self, bucket: list[SyncEntry]):
        # ZeRO-2 parameters are this rank's own, written by a step long finished: no wait. A ZeRO-3
        # gather is ordered on the current stream only, and its memory goes back when the bucket is
        # released: readers on other streams (vLLM's packing streams, which pull this iterator with
        # their stream current) must see it landed and must have read it by then. A stream's wait,
        # never the whole device's.
        stream_sync = self.zero_stage == 3 and not self.on_cpu
        with self._gathered([p for e in bucket for p in e.params]):
            if stream_sync:
                torch.cuda.current_stream(self.device).synchronize()
            # A LoRA target's value is a new merged tensor (bandpo.actor.lora): the weights stay as they are.
            yield [(e.name, e.value()) for e in bucket]
            if stream_sync:
                torch.cuda.current_stream(self.device).synchronize()

    @contextmanager
    def _gathered(self, params):
        if self.zero_stage != 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(HF name, dtype, full shape) of every parameter, in ``gathered_buckets``' order, without a gather."""
        return [
            (e.name, e.param.dtype, tuple(getattr(e.param, "ds_shape", e.param.shape)))
            for e in sync_entries(self.engine.module)
        ]

    def weight_checksums(self, dtypes: dict[str, list[str]]) -> dict:
        """Checksums of the weights a sync sends, cast to the dtypes the engines hold them in
        (``bandpo.weight_sync.checksums.actor_checksums``); rank 0 returns them, the others an empty dict.
        Collective under ZeRO-3 (each bucket's gather); under ZeRO-2 the other ranks return at once."""
        from bandpo.weight_sync.checksums import actor_checksums

        if self.rank != 0:
            if self.zero_stage == 3:
                for _ in self.gathered_buckets():  # take part in the gathers
                    pass
            return {}
        return actor_checksums(iter_tensors(self.gathered_buckets()), dtypes)

    def state_fingerprint(self) -> float:
        """Sum of |parameter| over the full model (float64); equal fingerprints ~ equal weights."""
        return float(sum(t.double().abs().sum() for b in self.named_weights() for _, t in b))

    def publish_weights_shm(self, paths: dict[int, str], relay: bool = False) -> list:
        """Write the full weights to one shared-memory file per node for the rollout engines.

        ``paths`` maps each writing rank (the lowest rank on each node) to its node's file;
        ``relay``: the file also goes to other nodes through Ray's object store, itself in /dev/shm,
        so the space checked is twice the file's.
        The file is sized from ``weight_specs`` first, then filled bucket by bucket straight from
        the (gathered) parameters: one copy through host memory, no full CPU copy of the model.
        Under ZeRO-3 every rank must call it (each bucket's gather is a collective); under
        ZeRO-2 every rank holds the full weights and a rank that writes nothing returns at once.
        Returns the tensor layout (``TensorMeta`` list) on writing ranks, else an empty list.
        """
        from bandpo.flat_buffer import plan_layout
        from bandpo.shm.weight_files import copy_into, open_weights_shm

        path = paths.get(self.rank)
        if path is None and self.zero_stage != 3:
            return []
        metas, total = plan_layout(self.weight_specs())
        buf = open_weights_shm(path, total, reserve=total if relay else 0) if path is not None else None
        by_name = {m.name: m for m in metas}
        for bucket in self.gathered_buckets():  # non-writing ZeRO-3 ranks: take part in the gathers
            if buf is not None:
                copy_into(buf, [by_name[n] for n, _ in bucket], [t for _, t in bucket])
        return metas if path is not None else []

    def publish_adapter(self, folder: str, with_files: bool = False) -> tuple[int, dict | None]:
        """Write the LoRA adapter into ``folder`` (PEFT format, ``bandpo.actor.lora_files``) for the
        engines of ``rollout.lora_sync=adapter``; rank 0 writes and returns the weights file's bytes and,
        with ``with_files``, the files' bytes for the engines' other nodes; the others return ``(0, None)``.

        Every rank is called, as for the shm sync: under ZeRO-3 the factors are partitioned and every
        rank takes part in their gather (one collective, the adapter being small); under ZeRO-2 every
        rank holds the whole adapter and the others return at once."""
        from bandpo.actor.lora_files import write_adapter
        from bandpo.lora_weights import lora_factors
        from bandpo.shm.adapter_dirs import read_adapter_files

        if self.rank != 0 and self.zero_stage != 3:
            return 0, None
        with self._gathered(lora_factors(self.engine.module)):
            nbytes = write_adapter(folder, self.engine.module, self.model_path) if self.rank == 0 else 0
        if self.rank != 0:
            return 0, None
        return nbytes, read_adapter_files(folder) if with_files else None

    def send_weights(
        self, transport: str, engines: list, engine_tp: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        """GPU weight sync into the engines without host memory (``bandpo.weight_sync.transport``):
        ``ipc`` (colocated) or ``nccl`` (split). Collective: every rank calls it. ``timeout_s``: the
        longest any one wait of it may take (``rollout.weight_sync_timeout``)."""
        if transport == "ipc":
            from bandpo.weight_sync.ipc import send_ipc

            send_ipc(
                self.gathered_buckets(),
                engines,
                driver=self.rank == 0,
                all_gather=self._all_gather_object,
                timeout_s=timeout_s,
            )
        elif transport == "nccl":
            from bandpo.flat_buffer import plan_layout
            from bandpo.weight_sync.ipc import exchange
            from bandpo.weight_sync.nccl import NcclSender

            failure = None
            if self.rank == 0 and getattr(self, "_nccl", None) is None:
                try:
                    self._nccl = NcclSender(engines, engine_tp, timeout_s)
                except Exception as e:
                    failure = e
            # the other ranks would wait for rank 0 in the first gather: tell them first
            if self.zero_stage == 3:
                exchange(self._all_gather_object, None, failure, "joining the NCCL group with the engines")
            elif failure is not None:
                raise failure
            if self.rank != 0:
                if self.zero_stage == 3:  # rank 0 sends: the others only take part in the gathers
                    for _ in self.gathered_buckets():
                        pass
                return
            self._nccl.send(plan_layout(self.weight_specs())[0], iter_tensors(self.gathered_buckets()))
        else:
            raise ValueError(f"send_weights: transport must be ipc or nccl, got {transport!r}")

    def node_id(self) -> str:
        """The Ray node this rank runs on (it publishes weights for that node's engines)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, t: torch.Tensor, max_: bool = False) -> torch.Tensor:
        """Sum (or max) of a small CPU tensor over ranks, via the device (NCCL needs GPU tensors)."""
        if self.world_size == 1:
            return t
        t = t.to(self.device)
        torch.distributed.all_reduce(
            t, op=torch.distributed.ReduceOp.MAX if max_ else torch.distributed.ReduceOp.SUM
        )
        return t.cpu()

    def _all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def _barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()
