"""Attention for packed rows without a [T, T] mask: causal SDPA over buckets of similar-length rows.

transformers' own ``sdpa`` handles a packed sequence (rows told apart by position ids
restarting) with a block-diagonal mask over the whole packed sequence: T^2 memory and T^2
compute, most of it across rows and thrown away (a micro-batch of 16k tokens holds a 16k x
16k mask). This implementation, registered with transformers under ``NAME``, never attends
across rows.

What a row attends is an ``AttentionLayout`` (built by ``bandpo.actor.packing.pack_rows`` and
passed to the model as the ``bandpo_layout`` keyword, which transformers hands down to the
attention function; without it, rows are read from ``position_ids`` restarting, as
``masking_utils.find_packed_sequence_indices`` does). An attention row reads the packed
positions of one or two spans, in order — its prompt and its response, contiguous or not —
and writes its output for the positions from ``write_from`` on. A response whose prompt is
shared with an earlier row of its group reads that row's prompt (``write_from`` = the prompt
length: the prompt's own outputs come from the row that holds it), so the prompt's
projections and MLP run once per group, not once per row (``share_prompts``).

Rows are sorted by length and cut into buckets whose shortest row is at least
``BUCKET_RATIO`` of the longest; each bucket is gathered into a right-padded [rows, heads,
L, d] batch and goes through one causal SDPA call. No mask is needed: with right padding
and ``is_causal``, a real query at column j attends columns 0..j, all of its own row; the
padded (and not written) queries' outputs are dropped, so their gradients, and those of
the padded keys that only they attend, are exactly zero. Compute is at most
1 / BUCKET_RATIO^2 of sum(len^2); the number of SDPA calls is the number of buckets (a
few), not rows x layers, which dominated micro-batches of hundreds of short rows. The same
varlen idea as flash-attention's packed path, with kernels every torch build has (CPU
included). Calls with an attention mask (padded batches, ZeRO-3 dummy passes) go to
transformers' ``sdpa`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAME = "bandpo_packed_sdpa"
LAYOUT_KW = "bandpo_layout"  # the model-call keyword that carries an AttentionLayout
BUCKET_RATIO = 0.8  # a bucket's shortest row / its longest: <= 1.56x the attention FLOPs of row by row


def _mask(*, attention_mask=None, **kwargs):
    """No mask for unpadded input (rows come from the layout); transformers' sdpa mask otherwise."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


@dataclass
class AttentionLayout:
    """Attention rows of a packed sequence of T tokens, bucketed for batched SDPA.

    Index tensors only, built on the host where the packing is known: the forward gathers and
    scatters with them and never asks the device which entries a mask selects (boolean-mask
    indexing is a device-to-host sync: on GPU one per bucket per layer, in forward,
    recomputation and backward alike).

    buckets: per bucket ``index`` [b, L] long: the packed position each column of a row reads
        (padding columns repeat the row's last position).
    source: [T] long, for each packed position, where its output is in the buckets' outputs
        flattened and concatenated (bucket by bucket, [b * L] each, rows then columns): the
        column of the one row that writes it.
    """

    buckets: list[torch.Tensor]
    source: torch.Tensor

    def to(self, device) -> AttentionLayout:
        return AttentionLayout([i.to(device) for i in self.buckets], self.source.to(device))


def build_layout(rows: torch.Tensor, total: int) -> AttentionLayout:
    """Layout of ``rows`` [n, 5] long — per attention row ``(start1, len1, start2, len2, write_from)``:
    it reads positions start1..start1+len1-1 then start2..start2+len2-1 and writes columns
    write_from..len1+len2-1. Every position of the packed sequence of ``total`` tokens must be
    written exactly once."""
    s1, l1, s2, l2, w = rows.unbind(-1)
    length = l1 + l2  # [n]
    buckets, dest, flat = [], [], []
    offset = 0  # where this bucket's flattened [b * L] outputs start
    for members in length_buckets(length.tolist()):
        m = torch.tensor(members)
        col = torch.arange(int(length[m[0]]))[None]  # [1, L]
        c = torch.minimum(col, length[m, None] - 1)  # [b, L]: padding columns repeat the last one
        index = torch.where(c < l1[m, None], s1[m, None] + c, s2[m, None] + c - l1[m, None])
        write = (col >= w[m, None]) & (col < length[m, None])
        buckets.append(index)
        dest.append(index[write])  # host tensors: no device sync
        flat.append(offset + torch.nonzero(write.flatten()).flatten())
        offset += index.numel()
    dest = torch.cat(dest) if dest else torch.zeros(0, dtype=torch.long)
    if dest.numel() != total or not bool((torch.bincount(dest, minlength=total) == 1).all()):
        raise ValueError(
            f"attention layout: the rows write {dest.numel()} outputs, not each of the {total} "
            "packed positions once"
        )
    source = torch.empty(total, dtype=torch.long)
    source[dest] = torch.cat(flat)
    return AttentionLayout(buckets, source)


def contiguous_rows(lens: list[int]) -> torch.Tensor:
    """Attention rows [n, 5] of rows packed back to back (each reads and writes its own positions)."""
    length = torch.tensor(lens, dtype=torch.long)
    start = length.cumsum(0) - length
    zero = torch.zeros_like(length)
    return torch.stack([start, length, start + length, zero, zero], dim=-1)


def row_lengths(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the packed rows of ``position_ids`` [1, T]: a row starts where a position is not
    the previous one + 1."""
    pos = position_ids.reshape(-1)
    starts = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *starts, pos.shape[0]]
    return [e - s for s, e in zip(bounds[:-1], bounds[1:])]


def length_buckets(lens: list[int], ratio: float = BUCKET_RATIO) -> list[list[int]]:
    """Indices of the non-empty rows, longest first, cut into buckets whose rows are all >= ``ratio``
    x the bucket's longest."""
    buckets: list[list[int]] = []
    for i in sorted((i for i in range(len(lens)) if lens[i] > 0), key=lambda i: -lens[i]):
        if not buckets or lens[i] < ratio * lens[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(i)
    return buckets


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] -> ([1, T, heads, d], None)."""
    position_ids = kwargs.get("position_ids")
    layout = kwargs.get(LAYOUT_KW)
    if attention_mask is not None or query.shape[0] != 1 or (position_ids is None and layout is None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            "packed attention: sliding-window layers are not supported; use actor.padding_free=false"
        )
    if layout is None:
        total = query.shape[2]
        layout = build_layout(contiguous_rows(row_lengths(position_ids)), total).to(query.device)
    groups = query.shape[1] // key.shape[1]
    p = dropout if module.training else 0.0
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, heads, d]
    parts = []
    for index in layout.buckets:
        # index_select, not x[index]: the backward of advanced indexing is an accumulating index_put,
        # which PyTorch runs on one thread on a CPU; index_select's is index_add (2.6x faster in bf16
        # at SmolLM2's shapes on 2 cores).
        flat = index.flatten()
        qb, kb, vb = (x.index_select(0, flat).unflatten(0, index.shape).transpose(1, 2) for x in (q, k, v))
        if groups > 1:  # grouped-query attention: share each kv head with its query heads
            kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, dropout_p=p, is_causal=True, scale=scaling
        )
        parts.append(out.transpose(1, 2).flatten(0, 1))  # [b * L, heads, d]
    # One gather picks each position's output from the row that writes it; its backward scatters
    # into unique indices (deterministic). The unwritten columns get zero gradient.
    return torch.cat(parts).index_select(0, layout.source)[None], None  # [1, T, heads, d]


def use_packed_attention(model) -> bool:
    """Switch a HF model whose attention is ``sdpa`` (the default without flash-attn) to bucketed
    packed attention; other implementations (flash-attention: already varlen) are left alone.
    Returns whether the model now uses it (shared prompts need it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return getattr(model.config, "_attn_implementation", None) == NAME
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    model.set_attn_implementation(NAME)
    return True
