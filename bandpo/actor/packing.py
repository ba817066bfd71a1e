"""Padding-free micro-batches: rows packed into one sequence, grouped by a token budget.

A packed micro-batch of n rows, row i with p_i prompt and r_i response tokens::

    input_ids    [1, T]   prompt_0 response_0 prompt_1 response_1 ...     T = sum_i (p_i + r_i)
    position_ids [1, T]   0 .. p_0+r_0-1      0 .. p_1+r_1-1 ...          (restart at 0 per row)

With ``share_prompts`` (GRPO's groups: the n samples of a prompt share it token for token), a
prompt already packed for an earlier row of the micro-batch is not packed again: the row
contributes only its response, at positions p .. p+r-1, and attends the earlier row's prompt
(``bandpo.actor.attention``: an attention row reads its prompt's span and its own). Causal
attention makes a prompt's hidden states the same in every row of its group, so log-probs
and gradients are those of the unshared packing (the prompt's gradient is the sum over the
rows, accumulated once instead of per row); a group of G rows costs p + sum r tokens instead
of G p + sum r.

``layout`` (an ``AttentionLayout``) says which packed positions each attention row reads and
writes; the model gets it as the ``bandpo_layout`` keyword. Without it, transformers
(masking_utils.find_packed_sequence_indices) and the packed attention read the row
boundaries from the position ids restarting (unshared rows only); the forward must get
``use_cache=False`` (checked against the padded forward in tests/unit/actor/test_actor_packed.py).

The hidden state predicting response token j of row i sits at offset_i + p_i - 1 + j (for a
shared prompt: token 0 is predicted by the prompt's last position, token j > 0 by the row's
own token j - 1); ``targets`` are the response tokens in row order, so the per-token results
[n_resp] map back to the padded layout [n, r] of the response mask (right-padded) with
``unpack``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bandpo.actor.attention import AttentionLayout, build_layout
from bandpo.config.checks import check_token_budget


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    target_index: torch.Tensor  # [n_resp] long, position in T of the hidden state predicting each target
    targets: torch.Tensor  # [n_resp] long, response tokens of all rows in row order
    response_mask: torch.Tensor  # [n, r] bool, where the targets go back (right-padded)
    layout: AttentionLayout  # which positions each attention row reads and writes

    def to(self, device) -> Packed:
        return Packed(*(t.to(device) for t in vars(self).values()))


def prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's prompt tokens (left padding dropped) [n]: rows with equal keys share their prompt."""
    lens = prompt_mask.sum(-1).tolist()
    return [tuple(row[len(row) - p :]) for row, p in zip(prompt_ids.tolist(), lens)]


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    share_prompts: bool = False,
) -> Packed:
    """Pack rows (prompts [n, P] left-padded, responses [n, R] right-padded) into one sequence;
    with ``share_prompts`` each distinct prompt is packed once (see the module docstring)."""
    p_lens = prompt_mask.sum(-1).tolist()
    r_lens = response_mask.sum(-1).tolist()
    r = max(max(r_lens, default=0), 1)
    keys = prompt_keys(prompt_ids, prompt_mask) if share_prompts else [None] * len(p_lens)
    ids, pos, index, rows = [], [], [], []  # rows: attention rows (start1, len1, start2, len2, write_from)
    packed_prompts: dict[tuple, int] = {}  # prompt key -> where that prompt starts in the sequence
    offset = 0
    for i, (p, n_r, key) in enumerate(zip(p_lens, r_lens, keys)):
        start = packed_prompts.get(key) if key is not None else None
        if start is None:  # the prompt, then the response, back to back
            ids += [prompt_ids[i, prompt_ids.shape[1] - p :], response_ids[i, :n_r]]
            pos.append(torch.arange(p + n_r))
            index.append(torch.arange(offset + p - 1, offset + p - 1 + n_r))
            rows.append((offset, p + n_r, offset + p + n_r, 0, 0))
            if key is not None:
                packed_prompts[key] = offset
            offset += p + n_r
        else:  # the response alone; it reads the prompt packed at `start`
            ids.append(response_ids[i, :n_r])
            pos.append(torch.arange(p, p + n_r))
            index.append(
                torch.cat([torch.tensor([start + p - 1]), torch.arange(offset, offset + n_r - 1)])[:n_r]
            )
            rows.append((start, p, offset, n_r, p))
            offset += n_r
    mask = response_mask[:, :r].bool()
    return Packed(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        target_index=torch.cat(index),
        targets=response_ids[:, :r][mask],
        response_mask=mask,
        layout=build_layout(torch.tensor(rows, dtype=torch.long).reshape(-1, 5), offset),
    )


def unpack(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token values [n_resp] back to the padded layout [n, r] (0 at padding), differentiable."""
    out = flat.new_zeros(mask.shape)
    out[mask] = flat
    return out


# With shared prompts a pass's attention reads more positions than it packs tokens (each row
# re-reads its prompt; bandpo.actor.attention): at most this many times the token budget, so a
# pass of long prompts with short answers cannot hold hundreds of rows.
ATTENTION_BUDGET_FACTOR = 2


def packed_budget_groups(
    p_lens: list[int], r_lens: list[int], budget: int, keys: list | None = None
) -> list[list[int]]:
    """Row indices grouped into forward passes of at most ``budget`` packed tokens (first-fit decreasing:
    longest first, into the first pass with room; passes in order of creation, rows sorted).

    Without ``keys`` a row costs p + r. With ``keys`` (``prompt_keys``) the rows of one prompt
    form a unit costing p + sum r packed tokens, its prompt packed once, and sum (p + r)
    attention positions, which a pass keeps within ``ATTENTION_BUDGET_FACTOR`` x ``budget``; a
    unit over either is cut, in row order, into pieces that fit (each packs the prompt again).
    A single row over the budget still gets a pass of its own.
    """
    check_token_budget(budget)
    if keys is None:
        units = [[i] for i in range(len(p_lens))]
    else:
        by_prompt: dict = {}
        for i, key in enumerate(keys):
            by_prompt.setdefault(key, []).append(i)
        units = []
        for rows in by_prompt.values():
            p = p_lens[rows[0]]
            piece, tokens, attention = [], p, 0
            for i in rows:
                if piece and (
                    tokens + r_lens[i] > budget
                    or attention + p + r_lens[i] > ATTENTION_BUDGET_FACTOR * budget
                ):
                    units.append(piece)
                    piece, tokens, attention = [], p, 0
                piece.append(i)
                tokens, attention = tokens + r_lens[i], attention + p + r_lens[i]
            units.append(piece)
    costs = [(p_lens[u[0]] + sum(r_lens[i] for i in u), sum(p_lens[i] + r_lens[i] for i in u)) for u in units]
    groups = _first_fit(costs, budget, ATTENTION_BUDGET_FACTOR * budget)
    return [sorted(i for u in group for i in units[u]) for group in groups]


def _first_fit(costs: list[tuple[int, int]], budget: int, attention_budget: int) -> list[list[int]]:
    """Indices of ``costs`` ((packed tokens, attention positions) each) grouped first-fit decreasing
    by tokens, each group within both budgets; an item over either budget gets a group of its own.
    Groups in order of creation, indices sorted."""
    groups: list[list[int]] = []
    room: list[list[int]] = []  # [tokens, attention positions] left per group
    for i in sorted(range(len(costs)), key=lambda i: -costs[i][0]):
        tokens, attention = costs[i]
        for g, left in enumerate(room):
            if tokens <= left[0] and attention <= left[1]:
                groups[g].append(i)
                left[0] -= tokens
                left[1] -= attention
                break
        else:
            groups.append([i])
            room.append([budget - tokens, attention_budget - attention])
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
