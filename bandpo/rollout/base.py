"""The rollout engine protocol, the backend registry, and input checks shared by the backends.

Shape legend (see ``bandpo.types``): B prompts, n samples each, N = B*n rows; the n rows of
prompt i are contiguous and carry ``prompt_index == i``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from bandpo.errors import check_choice

if TYPE_CHECKING:
    import torch

    from bandpo.flat_buffer import TensorMeta
    from bandpo.types import RolloutBatch, SamplingParams

OverlongPolicy = Literal["error", "truncate"]


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses and accepts new weights without restarting."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt.

        Returns a batch of N = len(prompt_token_ids) * n rows, prompt i's rows contiguous with
        ``prompt_index == i``; ``rollout_logprobs`` [N, R] are log-probs of the sampled tokens
        under the distribution actually sampled (after temperature / top-k / top-p).
        An empty prompt list gives an empty batch (N = 0).
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors under Hugging Face parameter names into the running engine."""
        ...

    def update_weights_from_shm(self, path: str, metas: list[TensorMeta]) -> None:
        """Load weights from a flat shared-memory buffer written by ``write_weights_shm``."""
        ...

    def weight_checksums(self) -> list[list[tuple]]:
        """Per worker (tensor-parallel rank), checksums of the weights the engine samples with, under
        checkpoint names: ``bandpo.weight_sync.checksums.EngineEntry`` tuples."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights + KV cache) for a colocated trainer; no-op if unsupported."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep``; no-op if unsupported."""
        ...

    def shutdown(self) -> None:
        """Free the engine's processes and memory."""
        ...


# Backends are imported on first use so that choosing "hf" never imports vLLM.
_REGISTRY: dict[str, str] = {
    "vllm": "bandpo.rollout.vllm_engine:VllmEngine",
    "hf": "bandpo.rollout.hf_engine:HfEngine",
}


def register_engine(name: str, target: str | Callable[..., RolloutEngine]) -> None:
    """Add a backend: ``target`` is a factory ``(model_path, **kwargs) -> RolloutEngine`` or ``"module:attr"``."""
    _REGISTRY[name] = target  # type: ignore[assignment]


def available_engines() -> list[str]:
    return sorted(_REGISTRY)


def make_engine(backend: str, model_path: str, **engine_kwargs) -> RolloutEngine:
    """Build the rollout engine registered under ``backend`` for the model folder / hub id ``model_path``."""
    check_choice(backend, available_engines(), "rollout backend")
    target = _REGISTRY[backend]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target(model_path, **engine_kwargs)


def check_prompts(
    prompt_token_ids: list[list[int]], max_model_len: int, policy: OverlongPolicy = "error"
) -> list[list[int]]:
    """Validate prompts against the context: each needs room for at least one generated token.

    ``policy="truncate"`` keeps the last ``max_model_len - 1`` tokens (the chat template's
    generation header sits at the end, so the tail is what must survive).
    """
    if policy not in ("error", "truncate"):
        raise ValueError(f"overlong_prompt must be 'error' or 'truncate', got {policy!r}")
    limit = max_model_len - 1
    out = []
    for i, p in enumerate(prompt_token_ids):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) > limit:
            if policy == "error":
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; the context (max_model_len={max_model_len}) "
                    f"allows at most {limit} prompt tokens"
                )
            p = p[-limit:]
        out.append(p)
    return out


def response_budget(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """Max new tokens for one prompt: the request's ``max_tokens`` capped by the room left in the context."""
    return max(1, min(max_tokens, max_model_len - prompt_len))


def empty_batch(pad_id: int) -> RolloutBatch:
    """A batch with N = 0 rows (for an empty prompt list)."""
    from bandpo.types import RolloutBatch

    return RolloutBatch.from_lists([], [], [], [], [], pad_id)
