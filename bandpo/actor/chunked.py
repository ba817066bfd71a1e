"""Log-probs and entropy of target tokens through the lm_head, chunk by chunk over tokens.

The obvious path (``bandpo.actor.logprobs``) materialises float32 logits [T, V] and a
softmax of the same size; with V = 151,936 that is 0.6 MB per token and pass. Here the
projection ``z = (h W^T) / temperature`` is done for ``chunk`` tokens at a time; forward
keeps only per-token log Z (logsumexp) and entropy, and backward recomputes each chunk's
logits to form its gradient. Extra memory is O(chunk x V), independent of T.

Per token t with target y, p = softmax(z), H = log Z - sum_k p_k z_k:
    d logp_y / dz_k = [k = y] - p_k
    d H / dz_k      = -p_k (z_k - E_p[z]),   E_p[z] = log Z - H
    d z / d(h W^T)  = 1 / temperature
and with G = dL/d(h W^T) [C, V]: dL/dh = G W, dL/dW += G^T h.

Precision (``actor.bf16``): the two matmuls with the [V, H] weight run in the weight's dtype,
as the model's own lm_head and the rollout engine's do: bf16 products accumulate in fp32 and
only the result is rounded, a logit z to within |z| 2^-8 (the engine's logits are rounded the
same way). Everything after that, over the vocabulary, is float32 (``_Workspace.logits`` upcasts first):
logsumexp, log p = z - log Z, the entropy and the gradient G = dL/dz. In bf16 each of those
results would be rounded again: log p to within |log p| 2^-8 (0.04 nats at log p = -10, a
ratio pi / pi_old off by 4% before any update), and the small probabilities that make up G
each by a relative 2^-8. The weight gradient dL/dW = G^T h is accumulated over the chunks in
float32 from the float32 G; only the gradient handed back to the hidden states, G W, takes the
weight's dtype, as the rest of the network's gradients do.

``fp32_head`` (``model.fp32_head``) runs both matmuls in float32 instead, on a float32 copy of the
weight: the logits are not rounded to bf16, as the engines' are not with vLLM's float32 head.
"""

from __future__ import annotations

import torch

from bandpo.config.checks import HEAD_CHOICES, check_chunk

DEFAULT_CHUNK = 512  # tokens: 512 x 151,936 x 4 B = 311 MB per float32 [chunk, V] buffer


class ChunkedLogprobEntropy(torch.autograd.Function):
    """``(logprobs [T], entropy [T])`` float32 from hidden [T, H], lm_head weight [V, H], targets [T]."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, fp32_head: bool = False):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        ws = _Workspace(min(chunk, n), weight, fp32_head)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logp = ws.logits(hidden[s:e], temperature)  # [C, V] float32, becomes log p in place
            lse[s:e] = ws.logsumexp(logp)
            logp -= lse[s:e, None]
            logprobs[s:e] = logp.gather(-1, targets[s:e, None]).squeeze(-1)
            # H = -sum p log p; exp underflow gives p = 0 next to a finite log p, so no 0 * inf.
            entropy[s:e] = -(ws.exp(logp).mul_(logp)).sum(-1)
            del logp
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.fp32_head = temperature, chunk, fp32_head
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n, t = hidden.shape[0], ctx.temperature
        ws = _Workspace(min(ctx.chunk, n), weight, ctx.fp32_head)
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            logp = ws.logits(hidden[s:e], t).sub_(lse[s:e, None])  # [C, V] log p
            p = ws.exp(logp)
            if grad_entropy is not None:  # g = -ge p (log p + H) = -ge p (z - E_p[z])
                g = logp.add_(entropy[s:e, None]).mul_(p).mul_(-grad_entropy[s:e, None].float())
                if grad_logprobs is not None:
                    g -= p.mul_(grad_logprobs[s:e, None].float())
            else:
                g = p.mul_(-grad_logprobs[s:e, None].float())
            if grad_logprobs is not None:
                g.scatter_add_(-1, targets[s:e, None], grad_logprobs[s:e, None].float())
            del logp, p
            g = g.div_(t)  # dL/d(h W^T), float32
            if need_h:
                grad_hidden[s:e] = ws.low_precision(g) @ ws.weight
            if need_w:  # from the float32 G: no bf16 rounding of its terms before the sum over tokens
                grad_weight.addmm_(g.t(), hidden[s:e].float())
        gw = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, gw, None, None, None, None


class _Workspace:
    """The [chunk, V] buffers of one pass, allocated once and reused by every chunk.

    Why: each chunk's logits, their float32 copy and exp are [chunk, V] tensors (100 MB each at 512 x
    49,152 in float32). Allocated per chunk, every one is above glibc's largest mmap threshold (32 MB),
    so it is mapped afresh and page-faulted in full: on CPU ~0.6 s of system time per 2,304 tokens and
    pass at SmolLM2's vocabulary. The arithmetic is the same ops in the same order as allocating ones
    (``torch.logsumexp``'s own steps included), so the results are bit-identical.
    """

    def __init__(self, rows: int, weight: torch.Tensor, fp32_head: bool = False):
        # [V, H], the lm_head's; ``fp32_head``: a float32 copy, the matmuls in float32 (no bf16 logits)
        self.weight = weight.float() if fp32_head else weight
        v, dev = weight.shape[0], weight.device
        self.z = torch.empty(rows, v, dtype=torch.float32, device=dev)  # logits, then log p
        self.p = torch.empty_like(self.z)  # exp(z - max), then p
        # the matmul's own result (its dtype), and G rounded to it for G W
        self.low = (
            None
            if self.weight.dtype == torch.float32
            else torch.empty(rows, v, dtype=weight.dtype, device=dev)
        )

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        """[C, V] float32 logits / temperature: the matmul in the weight's dtype, the result upcast
        before any arithmetic over the vocabulary (module docstring)."""
        c = hidden.shape[0]
        z = self.z[:c]
        if self.low is None:
            torch.mm(hidden.to(self.weight.dtype), self.weight.t(), out=z)
        else:
            z.copy_(torch.mm(hidden, self.weight.t(), out=self.low[:c]))
        return z.div_(temperature) if temperature != 1.0 else z

    def logsumexp(self, z: torch.Tensor) -> torch.Tensor:
        """``torch.logsumexp(z, -1)`` [C] by its own steps (max, exp of the difference, sum, log, plus
        the max; an infinite max taken as 0), with the [C, V] difference in the workspace."""
        m = z.amax(-1, keepdim=True)
        m.masked_fill_(m.abs() == float("inf"), 0)
        diff = torch.sub(z, m, out=self.p[: z.shape[0]])
        return diff.exp_().sum(-1).log_().add_(m.squeeze(-1))

    def exp(self, z: torch.Tensor) -> torch.Tensor:
        """``z.exp()`` [C, V], in the workspace."""
        return torch.exp(z, out=self.p[: z.shape[0]])

    def low_precision(self, g: torch.Tensor) -> torch.Tensor:
        """``g`` [C, V] float32 rounded to the weight's dtype (``g.to(weight.dtype)``), in the workspace."""
        return g if self.low is None else self.low[: g.shape[0]].copy_(g)


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / temperature)[target] and the entropy of that softmax, per token.

    hidden [T, H] (the last hidden states predicting ``targets``), weight [V, H] (the lm_head's),
    targets [T] long. Returns float32 ``(logprobs [T], entropy [T])``; both are differentiable
    (the entropy's gradient is computed only when the loss uses it). ``fp32_head``: the matmuls in
    float32 for a bf16 weight (a float32 copy of it for the call); the gradients keep their dtypes.
    """
    check_chunk(chunk)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [T, H] and weight [V, H] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    return ChunkedLogprobEntropy.apply(
        hidden, weight, targets, float(temperature), int(chunk), bool(fp32_head)
    )


def _chunked(hidden, weight, targets, temperature, chunk, fp32_head=False):
    return chunked_logprobs_entropy(
        hidden, weight, targets, temperature=temperature, chunk=chunk, fp32_head=fp32_head
    )


def _online(hidden, weight, targets, temperature, chunk, fp32_head=False):
    from bandpo.actor.online_head import online_logprobs_entropy

    return online_logprobs_entropy(
        hidden, weight, targets, temperature=temperature, block=chunk, fp32_head=fp32_head
    )


# ``actor.logprob_head``: the implementations of the same per-token (log-prob, entropy) head, each
# called as (hidden [T, H], weight [V, H], targets [T], temperature, chunk[, fp32_head]) -> (logprobs [T],
# entropy [T]); ``chunk`` is the tokens per chunk (chunked) or per block of the vocabulary walk (online).
HEADS = {"online": _online, "chunked": _chunked}
# the config validates actor.logprob_head against HEAD_CHOICES without importing the actor
assert HEAD_CHOICES == ("auto", *HEADS), (HEAD_CHOICES, tuple(HEADS))


def resolve_head(name: str, on_cpu: bool) -> str:
    """The head ``actor.logprob_head=name`` runs: ``auto`` = ``online`` on CPU, where it was measured
    faster at both vocabularies and dtypes (benchmarks/head.py), ``chunked`` on GPU, where it has not
    been measured yet; an unknown name is an error listing the valid ones."""
    if name not in HEAD_CHOICES:
        raise ValueError(f"actor.logprob_head={name!r}: unknown, valid: {', '.join(HEAD_CHOICES)}")
    if name == "auto":
        return "online" if on_cpu else "chunked"
    return name
