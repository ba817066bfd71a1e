"""Stand-in batches for code that reads a batch's shapes and log-probs, not its text (no model needed)."""

from __future__ import annotations

import torch

from bandpo.types import TrainBatch


def ones_batch(n: int, r: int, rollout_logprobs: torch.Tensor, **fields) -> TrainBatch:
    """``n`` rows whose prompt and response are ``r`` tokens of id 1, every one valid, one prompt each,
    with the engines' ``rollout_logprobs`` [n, r] and any other ``TrainBatch`` field in ``fields``."""
    ids = torch.ones(n, r, dtype=torch.long)
    return TrainBatch(
        prompt_ids=ids,
        prompt_mask=ids,
        response_ids=ids,
        response_mask=ids,
        rollout_logprobs=rollout_logprobs,
        prompt_index=torch.arange(n),
        finish_reasons=["stop"] * n,
        **fields,
    )
