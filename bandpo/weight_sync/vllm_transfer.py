"""vLLM's own weight-transfer engines driven over our rollout actors (GPU NCCL / IPC backends).

No production caller yet: the trainer syncs through node-local /dev/shm files (``bandpo.weight_sync``).
"""

from __future__ import annotations

from typing import Any


class VllmWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over our rollout actors.

    Lets a trainer drive vLLM's own transfer engines (e.g. ``NCCLTrainerWeightTransferEngine``
    for rollout GPUs separate from the trainer's) against ``RolloutWorker`` actors whose
    engines were built with ``weight_transfer_config={"backend": "nccl"}``.
    """

    def __init__(self, workers: list) -> None:
        self.workers = workers

    def _all(self, op: str, payload: Any = None) -> None:
        import ray

        ray.get([w.weight_transfer.remote(op, payload) for w in self.workers])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init", init_info)

    def start_weight_update(self) -> None:
        self._all("start")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish", weight_version)
