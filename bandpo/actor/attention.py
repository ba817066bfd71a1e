"""Attention for packed rows without a [T, T] mask: causal SDPA row by row.

transformers' own ``sdpa`` handles a packed sequence (rows told apart by position ids
restarting) with a block-diagonal mask over the whole packed sequence: T^2 memory and T^2
compute, most of it across rows and thrown away (a micro-batch of 16k tokens holds a 16k x
16k mask). This implementation, registered with transformers under ``NAME``, finds the row
boundaries in ``position_ids`` (where a position is not the previous one + 1, as
``masking_utils.find_packed_sequence_indices`` does) and runs causal SDPA on each row:
compute sum(len^2), no mask at all. The same varlen idea as flash-attention's packed path,
with kernels every torch build has (CPU included). Calls with an attention mask (padded
batches, ZeRO-3 dummy passes) go to transformers' ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch

NAME = "bandpo_packed_sdpa"


def _mask(*, attention_mask=None, **kwargs):
    """No mask for unpadded input (rows come from position ids); transformers' sdpa mask otherwise."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] -> ([1, T, heads, d], None)."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or query.shape[0] != 1 or position_ids is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("packed attention: sliding-window layers are not supported; use actor.padding_free=false")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: share each kv head with its query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    pos = position_ids.reshape(-1)  # [T]
    starts = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *starts, pos.shape[0]]
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    p = dropout if module.training else 0.0
    # split, not slicing: a slice's backward writes a zero-filled [1, heads, T, d] per row
    # (rows x T work), split's backward is one concatenation.
    out = [
        torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling)
        for q, k, v in zip(query.split(lens, dim=2), key.split(lens, dim=2), value.split(lens, dim=2))
    ]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def use_packed_attention(model) -> None:
    """Switch a HF model whose attention is ``sdpa`` (the default without flash-attn) to row-wise
    packed attention; other implementations (flash-attention: already varlen) are left alone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    model.set_attn_implementation(NAME)
