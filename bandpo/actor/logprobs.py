"""Per-token log-probs and entropy of response tokens from a causal LM (pure torch).

One row as the model sees it::

    [pad .. pad  prompt tokens | response tokens  pad .. pad]
     prompt_ids [N, P] left-padded | response_ids [N, R] right-padded

    input_ids      = concat(prompt_ids, response_ids)        # [N, P+R]
    attention_mask = concat(prompt_mask, response_mask)      # [N, P+R]
    position_ids   = cumsum(attention_mask) - 1, clamped >= 0  (left padding does not shift positions)

The logit predicting response token j sits at input position P - 1 + j, so the model only
has to project the last R + 1 hidden states onto the vocabulary (``logits_to_keep``).

That padded path (``response_logits`` + ``token_logprobs``/``token_entropy``) materialises
float32 logits [n, R, V]: it is the slow, obvious reference. The production path is
``packed_logprobs``: rows packed without padding (``bandpo.actor.packing``) and the lm_head
replaced, for the duration of the forward, by the chunked log-prob/entropy head
(``bandpo.actor.chunked``), so no [tokens, V] tensor larger than a chunk ever exists.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from bandpo.actor.attention import LAYOUT_KW
from bandpo.actor.chunked import HEADS
from bandpo.actor.packing import Packed, unpack
from bandpo.config.checks import check_token_budget


def check_padding(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Raise if prompts are not left-padded (>= 1 real token) or responses not right-padded."""
    if prompt_mask.shape[1] == 0 or not bool(prompt_mask[:, -1].all()):
        rows = [] if prompt_mask.shape[1] == 0 else (prompt_mask[:, -1] == 0).nonzero().flatten().tolist()
        raise ValueError(
            f"prompt_mask must be left-padded with >= 1 prompt token per row; bad rows {rows[:8]}"
        )
    if response_mask.shape[1] > 1:
        bad = (response_mask[:, 1:] > response_mask[:, :-1]).any(-1)
        if bool(bad.any()):
            raise ValueError(
                f"response_mask must be right-padded; bad rows {bad.nonzero().flatten()[:8].tolist()}"
            )


def trim_padding(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop columns that are padding in every row: leading prompt columns, trailing response columns.

    Returns ``(prompt_ids [n, p], prompt_mask [n, p], response_ids [n, r], response_mask [n, r])``
    with p <= P and 1 <= r <= R; the first r response columns are kept, so per-token tensors
    of the caller are sliced with ``[:, :r]``.
    """
    p_keep = int(prompt_mask.sum(-1).max())
    r_keep = max(int(response_mask.sum(-1).max()), 1)
    p_cols = slice(prompt_ids.shape[1] - p_keep, None)
    return prompt_ids[:, p_cols], prompt_mask[:, p_cols], response_ids[:, :r_keep], response_mask[:, :r_keep]


def model_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids`` (all [n, P+R]) for a HF causal LM."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def response_logits(
    model, prompt_ids, prompt_mask, response_ids, response_mask, *, temperature: float = 1.0
) -> torch.Tensor:
    """Logits [n, R, V] (float32) predicting each response token.

    ``model`` is a HF causal LM or a DeepSpeed engine around one.
    """
    width = response_ids.shape[1]
    out = model(
        **model_inputs(prompt_ids, prompt_mask, response_ids, response_mask),
        use_cache=False,
        logits_to_keep=width + 1,
    )
    # [n, R, V], the prediction after the last column dropped. Upcast before the log-softmax: under
    # bf16 the logits are rounded once by the lm_head, the sums over V and log p then stay float32
    # (why: bandpo.actor.chunked's docstring).
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids]: logits [n, R, V], ids [n, R] -> [n, R].

    Written as gather - logsumexp so no second [n, R, V] tensor (the log-softmax) is kept.
    """
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [n, R]
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: [n, R, V] -> [n, R].

    H = logsumexp(z) - sum softmax(z) z, which avoids log(0) for vanishing probabilities.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def budget_chunks(prompt_lens: list[int], response_lens: list[int], token_budget: int) -> list[list[int]]:
    """Group row indices into forward passes of at most ``token_budget`` padded tokens each.

    A group of rows costs rows * (longest prompt + longest response) tokens after trimming.
    Rows are taken longest first, so rows of similar length share a pass and padding stays
    small; a row longer than the budget forms a pass of its own.
    """
    check_token_budget(token_budget, "token_budget")
    order = sorted(range(len(prompt_lens)), key=lambda i: prompt_lens[i] + response_lens[i], reverse=True)
    chunks: list[list[int]] = []
    cur: list[int] = []
    max_p = max_r = 0
    for i in order:
        p, r = max(max_p, prompt_lens[i]), max(max_r, max(response_lens[i], 1))
        if cur and (len(cur) + 1) * (p + r) > token_budget:
            chunks.append(cur)
            cur, p, r = [], prompt_lens[i], max(response_lens[i], 1)
        cur.append(i)
        max_p, max_r = p, r
    if cur:
        chunks.append(cur)
    return chunks


def packed_logprobs(
    model,
    packed: Packed,
    *,
    temperature: float = 1.0,
    chunk: int,
    entropy_grad: bool = False,
    head: str = "chunked",
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy [n, r] (float32, 0 at padding) of a packed micro-batch.

    ``model`` is a HF causal LM or a DeepSpeed engine around one; the forward goes through it
    (DeepSpeed's hooks, gradient checkpointing and ZeRO-3 gathers included) with its output
    embedding computing per-token results instead of logits. The entropy carries a gradient
    only with ``entropy_grad`` (an entropy bonus in the loss); otherwise it is detached. ``head`` names
    the implementation (``bandpo.actor.chunked.HEADS``: ``chunked``, or ``online``, the one-pass walk
    over vocabulary tiles); ``chunk`` is its tokens per chunk or block; ``fp32_head`` runs its matmuls
    in float32 for a bf16 model.
    """
    if head not in HEADS:
        raise ValueError(f"packed_logprobs: head={head!r} unknown, valid: {', '.join(HEADS)}")
    fn = functools.partial(HEADS[head], fp32_head=fp32_head)
    with _chunked_head(model, packed.targets, temperature, chunk, entropy_grad, fn):
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            logits_to_keep=packed.target_index,
            **{LAYOUT_KW: packed.layout},  # the packed attention reads the rows (and shared prompts) from it
        )
    per_token = out.logits[0]  # [n_resp, 2]: (logprob, entropy)
    return unpack(per_token[:, 0], packed.response_mask), unpack(per_token[:, 1], packed.response_mask)


@contextmanager
def _chunked_head(model, targets: torch.Tensor, temperature: float, chunk: int, entropy_grad: bool, fn):
    """Swap the output embedding's forward for the chunked head; tied weights stay shared
    (the head reads ``weight`` of the module, which is the embedding's when tied)."""
    hf = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    config = getattr(hf, "config", None)
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, key, None) not in (None, 1.0):
            raise ValueError(
                f"packed log-probs: the model's {key}={getattr(config, key)} is not supported; "
                "use actor.padding_free=false"
            )
    head = hf.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            "packed log-probs: an lm_head with a bias is not supported; use actor.padding_free=false"
        )

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # [1, n_resp, H] -> [1, n_resp, 2]
        lp, ent = fn(hidden[0], head.weight, targets, temperature, chunk)
        return torch.stack([lp, ent if entropy_grad else ent.detach()], dim=-1)[None]

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
