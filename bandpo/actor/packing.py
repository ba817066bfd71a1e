"""Padding-free micro-batches: rows packed into one sequence, grouped by a token budget.

A packed micro-batch of n rows, row i with p_i prompt and r_i response tokens::

    input_ids    [1, T]   prompt_0 response_0 prompt_1 response_1 ...     T = sum_i (p_i + r_i)
    position_ids [1, T]   0 .. p_0+r_0-1      0 .. p_1+r_1-1 ...          (restart at 0 per row)

No attention mask is passed: transformers (masking_utils.find_packed_sequence_indices) reads
the row boundaries from the position ids restarting and builds a block-diagonal causal
mask (only without a KV cache: the forward must get ``use_cache=False``; flash-attention
kernels take the same boundaries as varlen offsets), so a token attends only to earlier tokens of its own row (checked against the padded
forward in tests/test_actor_packed.py).

The hidden state predicting response token j of row i sits at offset_i + p_i - 1 + j;
``targets`` are the response tokens in row order, so the per-token results [n_resp] map back
to the padded layout [n, r] of the response mask (right-padded) with ``unpack``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    target_index: torch.Tensor  # [n_resp] long, position in T of the hidden state predicting each target
    targets: torch.Tensor  # [n_resp] long, response tokens of all rows in row order
    response_mask: torch.Tensor  # [n, r] bool, where the targets go back (right-padded)

    def to(self, device) -> Packed:
        return Packed(*(t.to(device) for t in vars(self).values()))


def pack_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> Packed:
    """Pack rows (prompts [n, P] left-padded, responses [n, R] right-padded) into one sequence."""
    p_lens = prompt_mask.sum(-1).tolist()
    r_lens = response_mask.sum(-1).tolist()
    r = max(max(r_lens, default=0), 1)
    ids, pos, index = [], [], []
    offset = 0
    for i, (p, n_r) in enumerate(zip(p_lens, r_lens)):
        ids += [prompt_ids[i, prompt_ids.shape[1] - p :], response_ids[i, :n_r]]
        pos.append(torch.arange(p + n_r))
        index.append(torch.arange(offset + p - 1, offset + p - 1 + n_r))
        offset += p + n_r
    mask = response_mask[:, :r].bool()
    return Packed(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        target_index=torch.cat(index),
        targets=response_ids[:, :r][mask],
        response_mask=mask,
    )


def unpack(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token values [n_resp] back to the padded layout [n, r] (0 at padding), differentiable."""
    out = flat.new_zeros(mask.shape)
    out[mask] = flat
    return out


def token_budget_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices grouped so each group's total tokens stay within ``budget`` (first-fit decreasing).

    Rows are placed longest first into the first group with room; a row longer than the
    budget gets a group of its own. Groups are returned in order of creation, rows sorted.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for g, left in enumerate(room):
            if lengths[i] <= left:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(budget - lengths[i])
    return [sorted(g) for g in groups]


def split_to_count(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Split groups until there are ``count`` of them (data-parallel ranks must run the same
    number of micro-batches): the group with the most tokens among those of >= 2 rows is
    halved, by tokens. ``count`` must not exceed the number of rows."""
    groups = [list(g) for g in groups]
    if count > sum(len(g) for g in groups):
        raise ValueError(f"cannot make {count} micro-batches from {sum(len(g) for g in groups)} rows")
    while len(groups) < count:
        g = max((g for g in groups if len(g) > 1), key=lambda g: sum(lengths[i] for i in g))
        groups.remove(g)
        by_len = sorted(g, key=lambda i: -lengths[i])
        a, b, ta, tb = [], [], 0, 0
        for i in by_len:  # greedy halving by tokens
            if ta <= tb:
                a.append(i)
                ta += lengths[i]
            else:
                b.append(i)
                tb += lengths[i]
        groups += [sorted(a), sorted(b)]
    return groups
