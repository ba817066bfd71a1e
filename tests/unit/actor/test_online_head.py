"""The one-pass head (``bandpo.actor.online_head``) against a float64 reference and the chunked head.

Tolerances are first-order rounding bounds computed per token and per gradient element (``_bounds``),
with u = 2^-24 for float32 (bf16's u = 2^-8 enters only through the logits' one rounding):

1. A logit z_k = h . w_k / T from a float32 dot product of length H (any blocking) is off by at most
   dz = (H + 2) u max_k sum_i |h_i w_ki| / T + u max_k |z_k|  (the sum's worst case, then the division).
2. log Z = m + log s with s a sum of V non-negative terms, each an exp with relative error <= 2u plus
   u |z_k - m| <= u D from its argument's rounding (D = max z - min z), rescaled at most once per tile
   (a = e^(m - m'), one product: 3u each, plus u |m - m'| from the exponent, whose sum over the tiles is
   <= D): s is off by a relative n_s = (V + 3 n_tiles + 8 + 2 D) u; r (terms of one sign) likewise, so
   r / s by 2 n_s A, A = max z - E_p z = |r / s|. The exact functions move with the logits by
   |d log p_k| <= 2 dz and |dH| <= E_p|z - E_p z| dz (dH/dz_k = -p_k (z_k - E_p z)). Per token, with
   B = max(1, |log Z|, max|z|) for the last few roundings of the sums and differences of such numbers:
       e_lp = 2 dz + n_s + 3 u B                          bounds log p_k for any k,
       e_H  = E_p|z - E_p z| dz + n_s (1 + 2 A) + 2 u B   bounds H.
3. G_k = dL/dz_k = gl [k = y] - p_k (ge log p_k + gl + ge H) (gl, ge: upstream / T). p_k = e^(log p_k) is
   off by relative e + u, e = max(e_lp, e_H), so G_k by B_G = p_k e (|gl| + |ge| (|log p_k + H| + 3)) + 4 u |G_k| (the 4
   elementwise roundings forming G). The matmuls add their float32 summation: over V for dL/dh, over T
   for dL/dW:
       B_h[t, i] = sum_k B_G[t, k] |w_ki| + (V + 2) u sum_k |G_tk| |w_ki|
       B_W[k, i] = sum_t B_G[t, k] |h_ti| + (T + 2) u sum_t |G_tk| |h_ti|
   and 2^-120 on both for float32's gradual underflow (the peaked rows' p_k ~ 1e-50).
Every bound is asserted to stay below 1% of the largest value compared (or 1e-2, for values below 1),
far below what a real mistake moves (a wrong sign, token, tile or temperature changes values by O(1)
relative), so they are not vacuous. Two float32 heads each within the bound of float64 are within twice it
of each other.
"""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.actor.chunked import HEADS, chunked_logprobs_entropy, resolve_head
from bandpo.actor.online_head import _tile_width, online_logprobs_entropy

U32, U16 = 2.0**-24, 2.0**-8


def _problem(t=37, h=16, v=503, scale=0.5, tile=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g) * scale
    weight = torch.randn(v, h, generator=g) * scale
    targets = torch.randint(0, v, (t,), generator=g)
    # the first entry, the last of the first tile, the first of the next, the last entry
    targets[:4] = torch.tensor([0, min(tile, v) - 1, min(tile, v - 1), v - 1])
    gl, ge = torch.randn(t, generator=g), torch.randn(t, generator=g)  # arbitrary upstream gradients
    return hidden, weight, targets, gl, ge


def _reference(hidden, weight, targets, temperature, gl, ge):
    """float64, the obvious way: full logits, log_softmax, entropy -sum p log p, autograd."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp_all = torch.log_softmax(h @ w.t() / temperature, -1)  # [T, V]
    lp = logp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = 0.0
    if gl is not None:
        loss = loss + (lp * gl.double()).sum()
    if ge is not None:
        loss = loss + (ent * ge.double()).sum()
    gh, gw = torch.autograd.grad(loss, (h, w))
    return lp.detach(), ent.detach(), gh, gw, logp_all.detach()


def _bounds(hidden, weight, targets, temperature, gl, ge, n_tiles, dz_extra=None):
    """The module docstring's bounds (float64): (on log p [T], on H [T], on dL/dh [T, H], on dL/dW [V, H]).
    ``dz_extra`` [T] adds a per-token bound on the logits' own error (bf16's rounding)."""
    h, w = hidden.double(), weight.double()
    t, v = h.shape[0], w.shape[0]
    _, ent, _, _, logp = _reference(hidden, weight, targets, temperature, gl, ge)
    z = h @ w.t() / temperature
    dz = (h.shape[1] + 2) * U32 * (h.abs() @ w.abs().t()).amax(-1) / temperature + U32 * z.abs().amax(-1)
    if dz_extra is not None:
        dz = dz + dz_extra
    p = logp.exp()
    ez = (p * z).sum(-1)  # E_p[z]
    a = z.amax(-1) - ez  # |r / s| at the end
    ea = (p * (z - ez[:, None]).abs()).sum(-1)  # E_p |z - E_p z|: H's sensitivity to the logits
    logz = torch.logsumexp(z, -1)
    d = z.amax(-1) - z.amin(-1)
    n_s = (v + 3 * n_tiles + 8 + 2 * d) * U32  # relative error of s (and r)
    big = torch.stack([torch.ones_like(a), logz.abs(), z.abs().amax(-1)]).amax(0)
    e_lp = 2 * dz + n_s + 3 * U32 * big  # [T], log p_k for any k
    e_h = ea * dz + n_s * (1 + 2 * a) + 2 * U32 * big  # [T]
    e = torch.maximum(e_lp, e_h)
    gl_ = torch.zeros(t, dtype=torch.float64) if gl is None else gl.double() / temperature
    ge_ = torch.zeros(t, dtype=torch.float64) if ge is None else ge.double() / temperature
    g = -p * (ge_[:, None] * logp + gl_[:, None] + (ge_ * ent)[:, None])
    g[torch.arange(t), targets] += gl_
    b_g = p * e[:, None] * (gl_.abs()[:, None] + ge_.abs()[:, None] * ((logp + ent[:, None]).abs() + 3))
    b_g = b_g + 4 * U32 * g.abs()
    b_h = b_g @ w.abs() + (v + 2) * U32 * (g.abs() @ w.abs())
    b_w = b_g.t() @ h.abs() + (t + 2) * U32 * (g.abs().t() @ h.abs())
    # float32's gradual underflow: each operation on numbers below 2^-126 is off by up to 2^-150 absolutely
    tiny = 2.0**-120
    return e_lp, e_h, b_h + tiny, b_w + tiny


def _run(fn, hidden, weight, targets, gl, ge):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fn(h, w, targets)
    loss = 0.0
    if gl is not None:
        loss = loss + (lp * gl).sum()
    if ge is not None:
        loss = loss + (ent * ge).sum()
    gh, gw = torch.autograd.grad(loss, (h, w))
    return lp.detach(), ent.detach(), gh, gw


def _assert_within(got, want, bound, name):
    err = (got.double() - want.double()).abs()
    assert bool((err <= bound).all()), (
        name,
        float((err - bound).max()),
        float(err.max()),
        float(bound.max()),
    )


UPSTREAM = ["both", "logp", "entropy"]


@pytest.mark.parametrize("upstream", UPSTREAM)
@pytest.mark.parametrize(
    "temperature,block,tile,scale",
    [
        (1.0, 5, 64, 0.5),  # blocks and tiles that divide neither T = 37 nor V = 503
        (0.7, 64, 100, 0.5),  # one block larger than T
        (1.0, 16, 1024, 0.5),  # one tile larger than V: the plain logsumexp
        (0.6, 8, 64, 2.0),  # logits up to ~ +-60: peaked rows, large rescalings between tiles
    ],
)
def test_online_head_equals_float64_reference_and_the_chunked_head(temperature, block, tile, scale, upstream):
    hidden, weight, targets, gl, ge = _problem(scale=scale, tile=tile)
    gl = None if upstream == "entropy" else gl
    ge = None if upstream == "logp" else ge
    n_tiles = math.ceil(weight.shape[0] / tile)
    ref = _reference(hidden, weight, targets, temperature, gl, ge)[:4]
    bounds = _bounds(hidden, weight, targets, temperature, gl, ge, n_tiles)
    online = _run(
        lambda h, w, y: online_logprobs_entropy(h, w, y, temperature=temperature, block=block, tile=tile),
        hidden,
        weight,
        targets,
        gl,
        ge,
    )
    chunked = _run(
        lambda h, w, y: chunked_logprobs_entropy(h, w, y, temperature=temperature, chunk=block),
        hidden,
        weight,
        targets,
        gl,
        ge,
    )
    for name, got, other, want, bound in zip(
        ("logp", "entropy", "d hidden", "d weight"), online, chunked, ref, bounds
    ):
        assert got.dtype == torch.float32
        _assert_within(got, want, bound, name)
        _assert_within(got, other, 2 * bound, name + " vs chunked")
        # not vacuous (module docstring)
        assert float(bound.max()) < 1e-2 * max(1.0, float(want.abs().max())), (name, float(bound.max()))
    assert float(ref[2].abs().max()) > 0.1 and float(ref[3].abs().max()) > 0.1  # not comparing zeros


def test_peaked_rows_get_their_small_entropy_without_cancellation():
    """H = log s - r / s with r taken relative to the running max. On a peaked row s = 1 + (the rest's
    mass), log s is that mass, and r / s is of the size of H: the error is a few u absolutely, whatever
    |log Z|. The textbook log Z - E_p[z] subtracts two numbers of size |log Z| (~800 here), each
    rounded by u |log Z| ~ 5e-5; the chunked head's log p = z - log Z carries the same rounding."""
    hidden, weight, targets, _, _ = _problem(scale=6.0)
    z64 = hidden.double() @ weight.double().t()
    logp = torch.log_softmax(z64, -1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    peaked = ref_ent < 1e-2
    assert int(peaked.sum()) >= 10, float(ref_ent.min())
    _, ent = online_logprobs_entropy(hidden, weight, targets, block=8, tile=64)
    # On any row log s <= H and |r / s| = E_p[m - z] <= H (-log p_k = m - z_k + log s >= m - z_k), so
    # their relative errors (n_s of the float32 bounds above) cost n_s H each, plus u for each of the
    # two last roundings (log, difference): H off by <= (2 + 2 n_s H) u, whatever |log Z|.
    d = z64.amax(-1) - z64.amin(-1)
    bound = U32 * (2 + 2 * (weight.shape[0] + 3 * 8 + 8 + 2 * d) * ref_ent)  # [T]; 8 tiles of 64
    assert bool(((ent.double() - ref_ent).abs() <= bound)[peaked].all())
    z = hidden @ weight.t()
    textbook = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    _, chunked = chunked_logprobs_entropy(hidden, weight, targets, chunk=8)
    for other in (textbook, chunked):  # the bound shows the difference
        assert float(((other.double() - ref_ent).abs() - 10 * bound)[peaked].max()) > 0


def test_bf16_online_head_equals_the_bf16_chunked_head_within_the_logits_rounding():
    g = torch.Generator().manual_seed(0)
    t, h, v, tile = 48, 64, 2000, 256
    hidden = torch.randn(t, h, generator=g).bfloat16()  # bf16 numbers: both heads multiply the same values
    weight = (0.05 * torch.randn(v, h, generator=g)).bfloat16()
    targets = torch.randint(0, v, (t,), generator=g)
    gl, ge = torch.randn(t, generator=g), torch.randn(t, generator=g)
    online = _run(
        lambda a, b, y: online_logprobs_entropy(a, b, y, block=16, tile=tile), hidden, weight, targets, gl, ge
    )
    chunked = _run(
        lambda a, b, y: chunked_logprobs_entropy(a, b, y, chunk=16), hidden, weight, targets, gl, ge
    )
    ref = _reference(hidden.float(), weight.float(), targets, 1.0, gl, ge)
    # Each head's logits are the float32 product rounded once to bf16: dz <= u16 |z| per side, added to the
    # float32 bound of step 1; dL/dh adds bf16's roundings of G (each side) and of each tile's or the whole
    # product: <= 4 u16 sum_k |G_k| |w_k|; each gradient is rounded once to bf16 at the end: u16 |its value|.
    z = hidden.double() @ weight.double().t()
    e_lp, e_h, b_h, b_w = _bounds(
        hidden.float(), weight.float(), targets, 1.0, gl, ge, math.ceil(v / tile), U16 * z.abs().amax(-1)
    )
    p = ref[4].exp()
    g_abs = (
        p * (ge.double()[:, None] * ref[4] + gl.double()[:, None] + (ge.double() * ref[1])[:, None])
    ).abs()
    g_abs[torch.arange(t), targets] += gl.double().abs()
    b_h = b_h + 4 * U16 * (g_abs @ weight.double().abs()) + U16 * ref[2].abs()
    b_w = b_w + U16 * ref[3].abs()
    for name, a, b, ref_x, bound in zip(
        ("logp", "entropy", "d hidden", "d weight"), online, chunked, ref, (e_lp, e_h, b_h, b_w)
    ):
        assert a.dtype == b.dtype
        _assert_within(a, ref_x, bound, name + " vs float64")
        _assert_within(a, b, 2 * bound, name + " vs chunked")
    # the bound is tight enough to matter: bf16 log p (one more rounding) breaks it
    assert float((online[0].bfloat16().float() - online[0]).abs().max()) > float(2 * e_lp.max())


@pytest.mark.parametrize("head", ["online", "chunked"])
def test_fp32_head_on_a_bf16_model_is_the_float32_head_on_the_same_numbers(head):
    """With ``fp32_head`` the matmuls take the bf16 numbers upcast (exactly), so the log-probs and
    entropies are the float32 head's bit for bit, and the gradients are its gradients rounded once to
    bf16 (each is accumulated in float32 and cast at the end)."""
    g = torch.Generator().manual_seed(1)
    t, h, v = 40, 32, 700
    hidden = torch.randn(t, h, generator=g).bfloat16()
    weight = (0.1 * torch.randn(v, h, generator=g)).bfloat16()
    targets = torch.randint(0, v, (t,), generator=g)
    gl, ge = torch.randn(t, generator=g), torch.randn(t, generator=g)
    fn = HEADS[head]
    bf = _run(lambda a, b, y: fn(a, b, y, 0.8, 16, fp32_head=True), hidden, weight, targets, gl, ge)
    f32 = _run(lambda a, b, y: fn(a, b, y, 0.8, 16), hidden.float(), weight.float(), targets, gl, ge)
    assert torch.equal(bf[0], f32[0]) and torch.equal(bf[1], f32[1])
    assert bf[2].dtype == bf[3].dtype == torch.bfloat16
    assert torch.equal(bf[2], f32[2].bfloat16()) and torch.equal(bf[3], f32[3].bfloat16())
    # without it the logits are rounded to bf16 and the log-probs move (by up to ~2 u16 max|z|)
    assert not torch.equal(
        _run(lambda a, b, y: fn(a, b, y, 0.8, 16), hidden, weight, targets, gl, ge)[0], f32[0]
    )


def test_heads_are_registered_and_auto_picks_online_on_cpu_only():
    assert set(HEADS) == {"online", "chunked"}
    assert resolve_head("auto", on_cpu=True) == "online"
    assert resolve_head("auto", on_cpu=False) == "chunked"
    assert resolve_head("chunked", on_cpu=True) == "chunked"
    with pytest.raises(ValueError, match="valid: auto, online, chunked"):
        resolve_head("fused", on_cpu=True)


def test_short_passes_widen_the_tiles_to_the_same_area():
    assert _tile_width(4096, 49_152, 512, 1024) == 1024  # full blocks: the tile as given
    assert _tile_width(64, 49_152, 512, 1024) == 8192  # 64 tokens: 8x wider, the same 512 x 1,024 entries
    assert _tile_width(37, 503, 64, 100) == 172
    assert _tile_width(1, 100, 512, 1024) == 100  # never wider than the vocabulary


def test_online_head_rejects_bad_shapes_and_sizes():
    hidden, weight, targets, _, _ = _problem()
    with pytest.raises(ValueError, match="tile"):
        online_logprobs_entropy(hidden, weight, targets, tile=0)
    with pytest.raises(ValueError, match="weight"):
        online_logprobs_entropy(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets"):
        online_logprobs_entropy(hidden, weight, targets[:3])
