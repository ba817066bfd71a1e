"""Log-probs in bf16 against fp32, within bounds derived from bf16's unit roundoff u = 2^-8.

Kept tiny: on a CPU without AVX512-BF16 / AMX PyTorch emulates bf16 matmuls (100x and more slower than fp32).

The bound for a whole network (``tests.helpers.actor.bf16_logprob_bound``), first order in u:

1. log p_y = z_y - logsumexp(z) moves by dz_y - sum_k p_k dz_k, so |d log p| <= 2 max_k |dz_k| (the
   same holds for the entropy's sensitivity up to a factor max|z - E_p z|; not used here).
2. z_k = h . w_k, with h the last hidden state (after the final norm) and w_k row k of the lm_head.
   The bf16 model differs from the fp32 one by roundings, each a relative error of at most u on the
   tensor it rounds:
   a. the logits themselves: the head's matmul accumulates in fp32 and rounds its result once,
      |dz_k| <= u |z_k| <= u max|z| (worst case);
   b. every rounding between the token's embedding row and h, and the rounding of w_k: they perturb
      the terms h_i w_ki of z_k by relative errors e_i. Counting them in transformers' Qwen2 in bf16
      along one layer: the attention branch's RMSNorm (normalised value cast to bf16, its weight, their
      product: 3), q/k/v projections (weight, bias, output: 3), rotary (cos/sin cast to bf16, q cos, q'
      sin, their sum: 4), attention output (1), o_proj (weight, output: 2), residual add (1) = 14; the MLP
      branch's RMSNorm (3), gate / up (weight, output: 2), SiLU and the product (2), down (weight,
      output: 2), residual add (1) = 10: 24 per layer. Outside the layers: the embedding row (1), the
      final norm (3), the lm_head weight w_k (1). n = 24 L + 5 roundings in all (53 for the tiny
      model's L = 2). Assuming each layer passes a relative error of its input on without
      amplifying it (RMSNorm at every branch's entry removes the scale), e_i is a sum of n
      independent rounding errors, each uniform on [-u, u] (variance u^2 / 3), so
      std(dz_k) <= u sqrt(n / 3) ||h * w_k||_2, and 6 standard deviations (a Gaussian tail of
      2e-9 per logit) bound it over a batch: |dz_k| <= 6 u sqrt(n / 3) m2, m2 = max_k ||h * w_k||_2.
   Together: max |log p_bf16 - log p_fp32| <= 2 u (max|z| + 6 sqrt(n / 3) m2).
3. Hand-checked on the fixed batch below (``make_rollout(6, 3)``, 35 response tokens) through the
   random tiny Qwen2 (``build_tiny_model`` defaults: H 128, L 2, tied 451 x 128 embedding):
   max|z| = 1.69, m2 = 0.372, n = 53:
       2 * 2^-8 * (1.69 + 6 * sqrt(53 / 3) * 0.372) = 0.0078125 * (1.69 + 6 * 4.203 * 0.372)
                                                    = 0.0078125 * 11.07 = 0.0865 nats.
   Measured on an AMD Zen 3 (emulated bf16): 0.0049 max, 0.0014 mean. The bound is the worst case
   of step 2a plus a 6-sigma envelope of 2b; the measured error shows that these roundings do
   not add up to more.
The head alone (first test) has no assumption to make: its inputs are the same numbers in both
dtypes, so only step 2a's rounding (and fp32 summation order) separates the two.
"""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.actor.attention import use_packed_attention
from bandpo.actor.chunked import chunked_logprobs_entropy
from bandpo.actor.logprobs import packed_logprobs
from bandpo.actor.packing import pack_rows
from tests.helpers.actor import U_BF16, bf16_logprob_bound, make_rollout

U_FP32 = 2.0**-24


def test_chunked_head_rounds_the_logits_once_and_keeps_the_vocabulary_math_in_fp32():
    g = torch.Generator().manual_seed(0)
    t, h, v = 64, 64, 2048
    # bf16 numbers to start with: both paths multiply exactly the same values
    hidden = torch.randn(t, h, generator=g).bfloat16()
    weight = (0.02 * torch.randn(v, h, generator=g)).bfloat16()
    targets = torch.randint(0, v, (t,), generator=g)

    lp16, ent16 = chunked_logprobs_entropy(hidden, weight, targets, chunk=16)
    lp32, ent32 = chunked_logprobs_entropy(hidden.float(), weight.float(), targets, chunk=16)
    assert lp16.dtype == ent16.dtype == torch.float32

    z = hidden.float() @ weight.float().t()  # [T, V]
    max_z = float(z.abs().max())
    terms = float((hidden.float().abs() @ weight.float().abs().t()).max())  # max_k sum_i |h_i w_ki|
    # |dz| <= u |z| (the bf16 result's one rounding) + 2 h 2^-24 sum|h_i w_ki| (either path's fp32
    # accumulation, worst case); log p and the entropy move by at most 2 max|dz| and 2 max|z| max|dz|,
    # plus 1e-6 for the fp32 log-softmax's own roundings (|log p| < 10: 10 x 2^-24 per step, a few steps).
    dz = U_BF16 * max_z + 2 * h * U_FP32 * terms
    lp_bound, ent_bound = 2 * dz + 1e-6, 2 * max_z * dz + 1e-6
    assert float((lp16 - lp32).abs().max()) <= lp_bound
    assert float((ent16 - ent32).abs().max()) <= ent_bound
    # The bound is tight enough to matter: log p rounded to bf16 (a bf16 log-softmax) would break it,
    # its spacing at |log p| ~ 7.6 is 2^-5.
    assert float((lp32.bfloat16().float() - lp32).abs().max()) > lp_bound, (max_z, lp_bound)

    # The backward runs too: gradients come back in the inputs' dtype, finite.
    hidden.requires_grad_()
    weight.requires_grad_()
    lp, ent = chunked_logprobs_entropy(hidden, weight, targets, chunk=16)
    gh, gw = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
    assert gh.dtype == gw.dtype == torch.bfloat16 and bool(gh.isfinite().all() and gw.isfinite().all())


def test_tiny_model_logprobs_in_bf16_agree_with_fp32_within_the_roundoff_bound(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    rb = make_rollout(6, 3)
    packed = pack_rows(rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask)
    mask = rb.response_mask.bool()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
        assert use_packed_attention(model)
        with torch.no_grad():
            lp, ent = packed_logprobs(model, packed, chunk=512)
        assert lp.dtype == ent.dtype == torch.float32  # the chunked head's fp32 results, uncast by the model
        out[dtype] = lp
    err = float((out[torch.bfloat16] - out[torch.float32]).abs()[mask].max())

    bound, terms = bf16_logprob_bound(tiny_model_dir, rb)
    assert terms["n"] == 53
    assert bound == pytest.approx(2 * 2**-8 * (terms["max_z"] + 6 * math.sqrt(53 / 3) * terms["m2"]))
    assert bound == pytest.approx(0.0865, rel=0.05)  # the hand computation in the module docstring
    assert 0 < err <= bound, (err, bound, terms)  # > 0: the bf16 model did run in bf16
