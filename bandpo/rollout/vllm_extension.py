"""Methods mixed into every vLLM worker (``worker_extension_cls``), called through ``LLM.collective_rpc``.

vLLM injects this class as an extra base of its worker class and refuses names the worker
already has, so every method carries the ``bandpo_`` prefix. ``self`` is the vLLM worker:
``self.model_runner`` owns the model.

Weights arrive in checkpoint (Hugging Face) format and go through vLLM's layerwise in-place
reload, which re-runs each layer's post-load processing (fused QKV / gate-up, CPU oneDNN
prepacking, quantization); plain ``model.load_weights`` would leave those derived copies stale.
"""

from __future__ import annotations

import logging

# vLLM's reload warns "<Layer>: Failed to load weights" for every layer that got no tensor.
# Two such layers are expected on every sync and need nothing: rotary embeddings (a computed
# cos/sin cache, never in a checkpoint) and a tied lm_head (its weight is the embedding's,
# refreshed with it; ``_bandpo_refresh_tied_head``). Any other layer's warning still shows.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ExpectedReloadWarnings(logging.Filter):
    def __init__(self, layers: set[str]):
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        expected = (
            record.msg == "%s: Failed to load weights" and bool(record.args) and record.args[0] in self.layers
        )
        return not expected


class BandpoWorkerExtension:
    """Weight loading entry points for the rollout engine.

    ``bandpo_load_shm``: the node-local /dev/shm file (``rollout.weight_sync=shm``; CPU).
    ``bandpo_begin_update`` / ``bandpo_load_ipc`` / ``bandpo_finish_update``: CUDA IPC buckets from the
    colocated actor ranks (``rollout.weight_sync=ipc``; ``VllmEngine.ipc_update``); ``bandpo_load_shm_bucket``
    the same bucketed load from /dev/shm, which runs on CPU (tests). The nccl transport
    goes through vLLM's own weight-transfer engine instead (``bandpo.weight_sync.nccl``).
    ``bandpo_weight_checksums``: what every transport is verified by (``bandpo.weight_sync.checksums``).
    """

    def bandpo_load_shm(self, path: str, wire_metas: list) -> int:
        """Reload all weights from the flat ``/dev/shm`` file ``path``; returns the number of tensors loaded."""
        from bandpo.shm.weight_files import read_weights_shm

        metas = list(wire_metas)
        self._bandpo_quiet_expected_warnings()
        self.model_runner.reload_weights(weights_iterator=read_weights_shm(path, metas))
        self._bandpo_refresh_tied_head()
        return len(metas)

    def bandpo_begin_update(self) -> None:
        """Start a bucketed update: layers collect their weights and are rebuilt once complete."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._bandpo_quiet_expected_warnings()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def bandpo_load_ipc(self, payloads: dict) -> int:
        """Load one CUDA IPC bucket, the one packed on this worker's GPU (``payloads``: GPU UUID ->
        payload), between ``bandpo_begin_update`` and ``bandpo_finish_update``."""
        import torch

        from bandpo.weight_sync.ipc import open_ipc_bucket

        weights = list(open_ipc_bucket(payloads))
        self._bandpo_load_bucket(weights)
        # The sender reuses the bucket's memory once this returns: the copies must have landed.
        torch.cuda.synchronize()
        return len(weights)

    def bandpo_load_shm_bucket(self, path: str, wire_metas: list) -> int:
        """Load one bucket from the flat /dev/shm file ``path`` between ``bandpo_begin_update`` and
        ``bandpo_finish_update``: the GPU sequence's load (``bandpo_load_ipc``) with shared memory
        where the GPU maps a CUDA IPC buffer, so that the bucketed reload runs on CPU too
        (``bandpo.weight_sync.shm_buckets``). The writer reuses the file once this returns."""
        from bandpo.shm.weight_files import read_weights_shm

        weights = list(read_weights_shm(path, list(wire_metas)))
        self._bandpo_load_bucket(weights)
        return len(weights)

    def _bandpo_load_bucket(self, weights: list) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights)

    def bandpo_finish_update(self) -> None:
        """Finish a bucketed update: layers that got no weights keep their old ones."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self.model_runner.reset_lora_state()
        self._bandpo_refresh_tied_head()

    def bandpo_weight_checksums(self) -> list[tuple]:
        """Checksums of the weights this worker samples with, under checkpoint names
        (``bandpo.weight_sync.checksums.module_entries``): the same call after every transport."""
        from bandpo.weight_sync.checksums import module_entries

        model = self.model_runner.get_model()
        return [tuple(e) for e in module_entries(model, head=getattr(model, "lm_head", None))]

    def _bandpo_tied_head(self):
        """The model's ``lm_head`` when it shares its weight with ``embed_tokens``, else None."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        head_w, embed_w = getattr(head, "weight", None), getattr(embed, "weight", None)
        if head_w is None or embed_w is None or head_w.data_ptr() != embed_w.data_ptr():
            return None
        return head

    def _bandpo_quiet_expected_warnings(self) -> None:
        """Install (once per worker process) the filter for the reload's expected warnings."""
        logger = logging.getLogger(_RELOAD_LOGGER)
        if any(isinstance(f, _ExpectedReloadWarnings) for f in logger.filters):
            return
        head = self._bandpo_tied_head()
        layers = {"RotaryEmbedding"} | ({type(head).__name__} if head is not None else set())
        logger.addFilter(_ExpectedReloadWarnings(layers))

    def _bandpo_refresh_tied_head(self) -> None:
        """CPU + tied embeddings: re-prepack the lm_head GEMM weight.

        A tied ``lm_head`` shares its ``weight`` with ``embed_tokens`` and gets no tensor of its
        own in the checkpoint, so the reload refreshes the shared table but skips the head's
        post-load step, which is what builds the oneDNN-prepacked copy the CPU logits GEMM reads.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        head = self._bandpo_tied_head()
        if head is None:
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
