"""Records passed between stages (problems, sampling settings, batches). Shapes are stated once, here.

Legend
    N = B*G   rows: B prompts x G responses each, responses of one prompt contiguous
    P         longest prompt in the batch (prompts are LEFT-padded)
    R         longest response in the batch (responses are RIGHT-padded)
Padding positions hold ``pad_id`` in id tensors, 0 in masks, and 0.0 in logprob tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch


@dataclass(frozen=True)
class Example:
    """One problem: ``answer`` is the ground truth as given by the source (the verifier normalises it)."""

    id: str
    problem: str
    answer: str
    source: str


@dataclass
class SamplingParams:
    """What the rollout engine samples with (mirrors the vLLM names)."""

    n: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 4096
    seed: int | None = None


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] long, 1 = real prompt token
    response_ids: torch.Tensor  # [N, R] long, right-padded
    response_mask: torch.Tensor  # [N, R] long, 1 = generated token
    rollout_logprobs: torch.Tensor  # [N, R] float32, log-prob under the sampling distribution
    prompt_index: torch.Tensor  # [N] long, which of the B prompts this row answers
    finish_reasons: list[str] = field(default_factory=list)  # [N] "stop" | "length"
    pad_id: int = 0

    @property
    def size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:  # [N] long
        return self.response_mask.sum(-1)

    @classmethod
    def from_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        prompt_index: Sequence[int],
        finish_reasons: Sequence[str],
        pad_id: int,
    ) -> RolloutBatch:
        """Pad ragged per-row lists ([N] lists of token ids / logprobs) into a batch."""
        if not (len(prompts) == len(responses) == len(logprobs) == len(prompt_index) == len(finish_reasons)):
            raise ValueError("from_lists: all per-row lists must have the same length N")
        for i, (r, lp) in enumerate(zip(responses, logprobs)):
            if len(r) != len(lp):
                raise ValueError(f"from_lists: row {i} has {len(r)} response tokens but {len(lp)} logprobs")
        prompt_ids, prompt_mask = pad(prompts, pad_id, left=True)
        response_ids, response_mask = pad(responses, pad_id, left=False)
        rollout_logprobs, _ = pad(logprobs, 0.0, left=False, dtype=torch.float32)
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=rollout_logprobs,
            prompt_index=torch.as_tensor(list(prompt_index), dtype=torch.long),
            finish_reasons=list(finish_reasons),
            pad_id=pad_id,
        )

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Stack batches row-wise, re-padding to the widest (prompt_index offsets are kept as given)."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        pad_id = batches[0].pad_id
        rows = [b.to_lists() for b in batches]
        return cls.from_lists(
            [p for r in rows for p in r[0]],
            [x for r in rows for x in r[1]],
            [x for r in rows for x in r[2]],
            [x for b in batches for x in b.prompt_index.tolist()],
            [x for b in batches for x in b.finish_reasons],
            pad_id,
        )

    def to_lists(self) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
        """Unpadded (prompts, responses, logprobs), one list per row."""
        prompts = [ids[m.bool()].tolist() for ids, m in zip(self.prompt_ids, self.prompt_mask)]
        responses = [ids[m.bool()].tolist() for ids, m in zip(self.response_ids, self.response_mask)]
        logprobs = [lp[m.bool()].tolist() for lp, m in zip(self.rollout_logprobs, self.response_mask)]
        return prompts, responses, logprobs


@dataclass
class TrainBatch(RolloutBatch):
    """A rollout batch plus what the update needs. Filled stage by stage in the trainer."""

    rewards: torch.Tensor | None = None  # [N] float32
    advantages: torch.Tensor | None = None  # [N] float32, broadcast over response tokens
    old_logprobs: torch.Tensor | None = None  # [N, R] float32, actor before the update
    ref_logprobs: torch.Tensor | None = None  # [N, R] float32, frozen reference (KL term)
    old_entropy: torch.Tensor | None = None  # [N, R] float32, entropy of pi_old per position (adaptive band)

    @classmethod
    def from_rollout(cls, batch: RolloutBatch, **extra) -> TrainBatch:
        return cls(**{f.name: getattr(batch, f.name) for f in fields(RolloutBatch)}, **extra)

    def select(self, rows: torch.Tensor | slice) -> TrainBatch:
        """Rows of the batch (a slice or index tensor), same column widths."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[rows]
            elif isinstance(v, list):
                idx = range(len(v))[rows] if isinstance(rows, slice) else rows.tolist()
                out[f.name] = [v[i] for i in idx]
            else:
                out[f.name] = v
        return replace(self, **out)


def pad(
    rows: Sequence[Sequence], value, *, left: bool, dtype: torch.dtype = torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ragged rows to a [N, max_len] tensor and its 0/1 mask (long)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if not len(r):
            continue
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        out[i, sl] = torch.as_tensor(list(r), dtype=dtype)
        mask[i, sl] = 1
    return out, mask
