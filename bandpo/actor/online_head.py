"""Log-probs and entropy of target tokens through the lm_head in one online pass over vocabulary tiles.

Same results as ``bandpo.actor.chunked`` (the same formulas, the same precision rules: the matmul
with the [V, H] weight in the weight's dtype, everything over the vocabulary in float32, dL/dW
accumulated in float32), computed differently: for a block of ``block`` tokens the vocabulary is
walked in tiles of ``tile`` entries, and each [block, tile] piece of the logits is used while it
is still in cache, then dropped. Per token the forward keeps, over the tiles seen so far,

    m   = max_k z_k                       (the running max)
    s   = sum_k e^(z_k - m)
    r   = sum_k e^(z_k - m) (z_k - m)
    z_y = the target's logit              (from the tile that holds it)

and when a tile raises the max from m to m', both sums move to the new reference: with
a = e^(m - m'), s' = a s and r' = a (r + (m - m') s). At the end

    log Z  = m + log s,      log p_y = z_y - log Z,      H = log Z - E_p[z] = log s - r / s.

r is kept relative to the running max so H comes out without the cancellation of log Z - E_p[z]
(both of size |z|) when the distribution is peaked. exp is taken once per logit.

The backward recomputes each tile's logits and forms dL/dz there (p = e^(z - log Z)):
    d logp_y / dz_k = [k = y] - p_k
    d H / dz_k      = -p_k (z_k - E_p[z]) = -p_k (log p_k + H)
so with upstream gl, ge: G_k = gl [k = y] - p_k (ge log p_k + gl + ge H), divided by the
temperature (folded into gl and ge). dL/dh += G W_tile, dL/dW_tile += G^T h.

Why: the whole-vocabulary chunk (``bandpo.actor.chunked``) streams [chunk, V] float32 buffers
through memory seven or eight times per pass (logits, max, difference, exp, sum, log p, exp
again, product); here each tile is written by the matmul and read back from cache.

Precision, bf16: each tile's G W_tile is a bf16 matmul (G rounded to bf16 first, as the chunked
head does) whose bf16 result is added into a float32 sum over the tiles, so dL/dh carries one
bf16 rounding per tile's partial product instead of one of the total: at most u sum_tiles
|G_t W_t| against u |G W|, u = 2^-8. In float32 every result equals the chunked head's up to
float32 summation order.
"""

from __future__ import annotations

import torch

from bandpo.errors import check_number

DEFAULT_BLOCK = 512  # tokens per block: K of the dL/dW matmul, large enough to keep it compute-bound
DEFAULT_TILE = (
    1024  # vocab entries per tile: a [512, 1024] float32 tile is 2 MiB, a core's L2 on the CPUs measured
)


def check_tile(tile, name: str = "tile") -> None:
    """Tokens per block or vocabulary entries per tile: an integer >= 1."""
    check_number(tile, name, low=1, integer=True)


class _Tiles:
    """Reused [block, tile] buffers (float32 logits, their exp, and the matmul's own dtype when not
    float32); the last, narrower tile and block take a contiguous prefix of each.

    ``fp32_head``: the matmuls run in float32 whatever the weight's dtype (each tile of the weight and
    each block of hidden states upcast, exactly), so the logits are not rounded to bf16.
    """

    def __init__(self, rows: int, cols: int, weight: torch.Tensor, fp32_head: bool):
        self.weight = weight  # [V, H]
        self.mm_dtype = torch.float32 if fp32_head else weight.dtype
        dev, n = weight.device, rows * cols
        self.z = torch.empty(n, dtype=torch.float32, device=dev)
        self.e = torch.empty(n, dtype=torch.float32, device=dev)
        self.low = None if self.mm_dtype == torch.float32 else torch.empty(n, dtype=weight.dtype, device=dev)

    def tile(self, v0: int, v1: int) -> torch.Tensor:
        """W[v0:v1] [Vt, H] in the matmul's dtype."""
        return self.weight[v0:v1].to(self.mm_dtype)

    def logits(self, hidden: torch.Tensor, v0: int, v1: int, temperature: float) -> torch.Tensor:
        """[C, v1 - v0] float32 (h W[v0:v1]^T) / temperature, the matmul in ``mm_dtype`` (``hidden`` in it)."""
        c, w = hidden.shape[0], self.tile(v0, v1)
        z = self.z[: c * (v1 - v0)].view(c, v1 - v0)
        if self.low is None:
            torch.mm(hidden, w.t(), out=z)
        else:
            z.copy_(torch.mm(hidden, w.t(), out=self.low[: z.numel()].view(z.shape)))
        return z.div_(temperature) if temperature != 1.0 else z

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x, out=self.e[: x.numel()].view(x.shape))

    def low_precision(self, g: torch.Tensor) -> torch.Tensor:
        """``g`` rounded to the weight's dtype, in the workspace."""
        return g if self.low is None else self.low[: g.numel()].view(g.shape).copy_(g)


def _tile_width(n: int, v: int, block: int, tile: int) -> int:
    """Vocabulary entries per tile for ``n`` tokens: ``tile``, widened when fewer than ``block`` tokens
    make the blocks narrower, so a tile keeps its ``block x tile`` entries (at most ``v``).

    Why: each tile costs a fixed ~10 operations; a short pass (a few dozen tokens) over tiles of
    1,024 would run hundreds of tiny ones, each a synchronisation of the threads, which on a loaded
    CPU costs far more than its arithmetic."""
    rows = max(min(block, n), 1)
    return min(v, max(tile, tile * block // rows))


def _target_in_tile(targets: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(in_tile [C] bool, column [C, 1] long)``: which targets fall in [v0, v1) and their column
    there (clamped into the tile for the others, whose value is then masked out)."""
    return (targets >= v0) & (targets < v1), (targets - v0).clamp_(0, v1 - v0 - 1)[:, None]


def _target_logits(hidden, weight, targets, temperature: float, mm_dtype: torch.dtype) -> torch.Tensor:
    """[C] float32 z_y = h . w_y / temperature, rounded to ``mm_dtype`` as the matmul's result is.

    One dot product per token instead of a gather from every tile; it differs from the tile's own
    value only by float32 summation order (and, in bf16, where that order tips the one rounding)."""
    z = torch.linalg.vecdot(hidden.float(), weight[targets].float())
    if mm_dtype != torch.float32:
        z = z.to(mm_dtype).float()
    return z / temperature if temperature != 1.0 else z


class OnlineLogprobEntropy(torch.autograd.Function):
    """``(logprobs [T], entropy [T])`` float32 from hidden [T, H], lm_head weight [V, H], targets [T]."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, block: int, tile: int, fp32_head: bool):
        n, v = hidden.shape[0], weight.shape[0]
        logz = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, logprobs = torch.empty_like(logz), torch.empty_like(logz)
        tile = _tile_width(n, v, block, tile)
        ws = _Tiles(min(block, n), tile, weight, fp32_head)
        for b0 in range(0, n, block):
            h, y = hidden[b0 : b0 + block].to(ws.mm_dtype), targets[b0 : b0 + block]
            m = s = r = None  # [C] running max, sum e^(z-m), sum e^(z-m)(z-m)
            zy = _target_logits(h, weight, y, temperature, ws.mm_dtype)
            for v0 in range(0, v, tile):
                v1 = min(v0 + tile, v)
                z = ws.logits(h, v0, v1, temperature)  # [C, Vt]
                m_new = z.amax(-1) if m is None else torch.maximum(m, z.amax(-1))
                d = z.sub_(m_new[:, None])  # z - m' <= 0
                e = ws.exp(d)
                s_t = e.sum(-1)
                r_t = e.mul_(d).sum(-1)  # in place: no [C, Vt] temporary
                if m is None:
                    s, r = s_t, r_t
                else:
                    shift = m - m_new  # <= 0
                    a = shift.exp()
                    r = a * (r + shift * s) + r_t
                    s = a * s + s_t
                m = m_new
            log_s = s.log()
            logz[b0 : b0 + block] = m + log_s
            entropy[b0 : b0 + block] = log_s - r / s
            logprobs[b0 : b0 + block] = zy - logz[b0 : b0 + block]
        ctx.save_for_backward(hidden, weight, targets, logz, entropy)
        ctx.temperature, ctx.block, ctx.tile, ctx.fp32_head = temperature, block, tile, fp32_head
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, logz, entropy = ctx.saved_tensors
        none = (None,) * 7
        if grad_logprobs is None and grad_entropy is None:
            return none
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, v, block, tile = hidden.shape[0], weight.shape[0], ctx.block, ctx.tile
        inv_t = 1.0 / ctx.temperature
        gl_all = None if grad_logprobs is None else grad_logprobs.float() * inv_t  # [T]
        ge_all = None if grad_entropy is None else grad_entropy.float() * inv_t  # [T]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        tile = _tile_width(n, v, block, tile)
        ws = _Tiles(min(block, n), tile, weight, ctx.fp32_head)
        for b0 in range(0, n, block):
            b1 = min(b0 + block, n)
            h, y, lz = hidden[b0:b1].to(ws.mm_dtype), targets[b0:b1], logz[b0:b1, None]
            gl = None if gl_all is None else gl_all[b0:b1]
            ge = None if ge_all is None else ge_all[b0:b1, None]
            if ge is not None:  # gl + ge H [C, 1]: the part of G's factor that is constant along the tile
                c = (
                    ge * entropy[b0:b1, None]
                    if gl is None
                    else torch.addcmul(gl[:, None], ge, entropy[b0:b1, None])
                )
            h32 = h.float() if need_w else None
            acc = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
            for v0 in range(0, v, tile):
                v1 = min(v0 + tile, v)
                logp = ws.logits(h, v0, v1, ctx.temperature).sub_(lz)  # [C, Vt] log p
                p = ws.exp(logp)
                if ge is not None:  # -p (ge log p + gl + ge H)
                    g = logp.mul_(ge.neg()).sub_(c).mul_(p)
                else:
                    g = p.mul_(gl.neg()[:, None])
                if gl is not None:
                    inside, col = _target_in_tile(y, v0, v1)
                    g.scatter_add_(1, col, torch.where(inside, gl, 0.0)[:, None])
                if need_h and ws.low is None:
                    acc.addmm_(g, ws.tile(v0, v1))
                elif need_h:  # the bf16 product of this tile, summed over the tiles in float32
                    acc += ws.low_precision(g) @ weight[v0:v1]
                if need_w:
                    grad_weight[v0:v1].addmm_(g.t(), h32)
            if need_h:
                grad_hidden[b0:b1] = acc
        gw = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, gw, None, None, None, None, None


def online_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    block: int = DEFAULT_BLOCK,
    tile: int = DEFAULT_TILE,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / temperature)[target] and the entropy of that softmax, per token.

    hidden [T, H], weight [V, H] (the lm_head's), targets [T] long in [0, V). Returns float32
    ``(logprobs [T], entropy [T])``, both differentiable in hidden and weight. ``fp32_head``: the
    matmuls in float32 for a bf16 weight and hidden states (their gradients keep their dtypes).
    """
    check_tile(block, "block")
    check_tile(tile, "tile")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [T, H] and weight [V, H] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets [T] expected for hidden {tuple(hidden.shape)}, got {tuple(targets.shape)}")
    return OnlineLogprobEntropy.apply(
        hidden, weight, targets, float(temperature), int(block), int(tile), bool(fp32_head)
    )
