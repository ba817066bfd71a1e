"""A rollout engine on transformers ``generate``: for machines without vLLM and for debugging.

Same contract as the vLLM engine. Temperature / top-k / top-p are applied by our own logits
processor (transformers runs custom processors before its built-in warpers, so with the
built-ins switched off ours is the last word): it returns the log-probs of the sampling
distribution, which ``generate`` then samples from, and it records the log-prob of each sampled
token one step later, when the token shows up in ``input_ids``. Nothing of size
[steps, rows, vocab] is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from bandpo.flat_buffer import TensorMeta
from bandpo.rollout.base import OverlongPolicy, check_prompts, empty_batch, response_budget
from bandpo.shm.weight_files import read_weights_shm
from bandpo.types import RolloutBatch, SamplingParams, pad

log = logging.getLogger(__name__)
# Engine options that only mean something to vLLM; accepted so one config drives either backend.
VLLM_ONLY = {
    "gpu_memory_utilization",
    "kv_cache_gib",
    "enforce_eager",
    "tensor_parallel_size",
    "enable_sleep_mode",
    "sleep_level",
    "enable_prefix_caching",
    "sync_dir",
}


class _SampleAndRecord:
    """Logits processor: scores [rows, V] -> log-probs of the sampling distribution [rows, V]."""

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.prev: torch.Tensor | None = None  # [rows, V] last step's sampling log-probs
        self.steps: list[torch.Tensor] = []  # per step [rows]: log-prob of the token sampled there

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        s = scores.float()
        if self.temperature != 1.0:
            s = s / self.temperature
        if 0 < self.top_k < s.shape[-1]:
            kth = s.topk(self.top_k, dim=-1).values[:, -1:]
            s = s.masked_fill(s < kth, float("-inf"))
        if self.top_p < 1.0:
            # Keep the smallest head of the sorted distribution whose mass reaches top_p (as vLLM does).
            sorted_s, order = s.sort(dim=-1, descending=True)
            probs = sorted_s.softmax(-1)
            drop = (probs.cumsum(-1) - probs) >= self.top_p
            drop[:, 0] = False
            s = s.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        self.prev = s.log_softmax(-1)
        return self.prev

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Close the last step with the final sampled tokens [rows]; returns [rows, steps] float32."""
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
        return torch.stack(self.steps, 1) if self.steps else torch.zeros(last_tokens.shape[0], 0)


class HfEngine:
    """Rollout engine on ``transformers`` ``generate``.

    Args:
        model_path: HF model folder or hub id.
        max_model_len: context length (prompt + response); default: the model's max positions.
        dtype: "auto" (the checkpoint's), "float32", "bfloat16", ...
        seed: seeds the engine's RNG, which draws a seed for each request that has none.
        device: "cuda" / "cpu"; default cuda when available.
        overlong_prompt: "error" (default) or "truncate" (keep the last max_model_len - 1 tokens).
        max_batch_rows: rows per ``generate`` call (bounds the KV cache).
        **vllm_only: vLLM options (see ``VLLM_ONLY``), accepted and ignored.
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        device: str | None = None,
        overlong_prompt: OverlongPolicy = "error",
        max_batch_rows: int = 256,
        **vllm_only,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        unknown = set(vllm_only) - VLLM_ONLY
        if unknown:
            raise TypeError(f"HfEngine got unknown options: {sorted(unknown)}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=_torch_dtype(dtype)).to(self.device).eval()
        )
        tok = AutoTokenizer.from_pretrained(model_path)
        self.eos_ids = _eos_ids(self.model.generation_config.eos_token_id, tok.eos_token_id)
        self.pad_id: int = tok.pad_token_id if tok.pad_token_id is not None else self.eos_ids[0]
        self.max_model_len: int = max_model_len or self.model.config.max_position_embeddings
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.overlong_prompt = overlong_prompt
        self.max_batch_rows = max_batch_rows
        self.rng = torch.Generator().manual_seed(seed)  # draws the seeds of requests that carry none

    # ---- sampling -------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt; see ``RolloutEngine.generate`` for the layout."""
        if not prompt_token_ids:
            return empty_batch(self.pad_id)
        prompts = check_prompts(prompt_token_ids, self.max_model_len, self.overlong_prompt)
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(sampling.n)]  # [N], prompt-major
        out_p, out_r, out_lp, out_i, out_f = [], [], [], [], []
        seed = (
            sampling.seed if sampling.seed is not None else int(torch.randint(2**62, (), generator=self.rng))
        )
        # generate() samples from the global RNG: fork it so the caller's random state is left alone.
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            for start in range(0, len(rows), self.max_batch_rows):
                chunk = rows[start : start + self.max_batch_rows]
                for (i, p), (resp, lps, reason) in zip(
                    chunk, self._generate_rows([p for _, p in chunk], sampling)
                ):
                    out_p.append(p)
                    out_r.append(resp)
                    out_lp.append(lps)
                    out_i.append(i)
                    out_f.append(reason)
        return RolloutBatch.from_lists(out_p, out_r, out_lp, out_i, out_f, self.pad_id)

    def _generate_rows(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[tuple[list[int], list[float], str]]:
        """One ``generate`` call over left-padded rows; returns (response ids, logprobs, finish reason) per row."""
        from transformers import GenerationConfig, LogitsProcessorList

        budgets = [response_budget(len(p), sampling.max_tokens, self.max_model_len) for p in prompts]
        ids, mask = pad(prompts, self.pad_id, left=True)  # [rows, P]
        recorder = _SampleAndRecord(sampling.temperature, sampling.top_k, sampling.top_p)
        config = GenerationConfig(
            do_sample=True,
            max_new_tokens=max(budgets),
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        seqs = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
        )  # [rows, P + steps]
        new = seqs[:, ids.shape[1] :]  # [rows, steps]
        lps = recorder.finish(new[:, -1]).cpu() if new.shape[1] else torch.zeros(len(prompts), 0)
        new = new.cpu()
        out = []
        eos = torch.tensor(self.eos_ids)
        for r, budget in enumerate(budgets):
            hits = torch.isin(new[r, :budget], eos).nonzero()
            if len(hits):
                end, reason = int(hits[0]) + 1, "stop"  # the EOS token is part of the response
            else:
                end, reason = min(budget, new.shape[1]), "length"
            out.append((new[r, :end].tolist(), lps[r, :end].tolist(), reason))
        return out

    # ---- weight sync ----------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model's parameters (tied ``lm_head.weight`` is skipped)."""
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            if self.tied and name == "lm_head.weight":
                continue
            if name not in params:
                raise KeyError(f"update_weights: the model has no parameter {name!r}")
            if tuple(params[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}"
                )
            params[name].copy_(t)

    def update_weights_from_shm(self, path: str, metas: list[TensorMeta]) -> None:
        """Load weights from a flat shared-memory file written by ``write_weights_shm``."""
        self.update_weights(read_weights_shm(path, metas))

    @torch.no_grad()
    def weight_checksums(self) -> list[list[tuple]]:
        """The model's checksums (``bandpo.weight_sync.checksums``), as the one worker of this engine."""
        from bandpo.weight_sync.checksums import entries_of

        return [[tuple(e) for e in entries_of(self.model.named_parameters())]]

    # ---- memory ---------------------------------------------------------------------------

    def sleep(self) -> None:
        """On GPU, park the weights in host memory and return the freed blocks to the driver; no-op on CPU.

        The colocated layout's counterpart of vLLM's sleep level 1 (``generate`` keeps no KV cache
        between calls, so the weights are all there is to free).
        """
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep``: ``tags`` as vLLM's (``["weights"]`` moves the weights back; ``["kv_cache"]``
        has nothing to allocate here); None wakes everything."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; valid: weights, kv_cache")
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            self.model.to(self.device)

    def shutdown(self) -> None:
        self.model = None


def _torch_dtype(name: str):
    """vLLM-style dtype names ("auto", "float", "half", "bfloat16", ...) -> what from_pretrained takes."""
    if name == "auto":
        return "auto"
    return getattr(torch, {"float": "float32", "half": "float16"}.get(name, name))


def _eos_ids(*candidates) -> list[int]:
    """Flatten EOS ids from the generation config and the tokenizer (either may be an int, a list, or None)."""
    out: list[int] = []
    for c in candidates:
        for x in c if isinstance(c, (list, tuple)) else [c]:
            if x is not None and int(x) not in out:
                out.append(int(x))
    if not out:
        raise ValueError("the model defines no EOS token")
    return out
