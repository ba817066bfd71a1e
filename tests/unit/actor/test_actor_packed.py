"""Padding-free actor: chunked lm_head log-probs vs the full-logit reference, packed vs padded
forwards and updates, old log-probs from the update's own forward, bounded memory at V = 151,936.

Tolerances: everything is float32. Log-probs/entropies are sums of a few hundred terms of
size O(1) (relative rounding ~6e-8 each), so two summation orders differ by ~1e-6; 1e-5
leaves a margin of 10 and still fails for any real mistake (a wrong token, mask or
temperature moves values by > 1e-2). Weights after one Adam step: see ``new_actor``.
"""

from __future__ import annotations

import pytest
import torch

from bandpo.actor.chunked import chunked_logprobs_entropy
from bandpo.actor.logprobs import model_inputs, token_entropy, token_logprobs, trim_padding
from bandpo.actor.packing import (
    pack_rows,
    packed_budget_groups,
    prompt_keys,
    split_to_count,
    unpack,
)
from bandpo.types import RolloutBatch
from tests.helpers.actor import make_rollout


# ---------------------------------------------------------------- chunked head vs full logits
@pytest.mark.parametrize("temperature,chunk", [(1.0, 5), (0.7, 64)])
def test_chunked_logprobs_entropy_and_grads_match_full_logits(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    t, h, v = 37, 16, 503
    hidden = (torch.randn(t, h, generator=g) / 2).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 2).requires_grad_()
    targets = torch.randint(0, v, (t,), generator=g)
    a, b = torch.randn(t, generator=g), torch.randn(t, generator=g)  # arbitrary upstream gradients

    lp, ent = chunked_logprobs_entropy(hidden, weight, targets, temperature=temperature, chunk=chunk)
    grads = torch.autograd.grad((lp * a).sum() + (ent * b).sum(), (hidden, weight))
    lp_only = torch.autograd.grad(
        (chunked_logprobs_entropy(hidden, weight, targets, chunk=chunk)[0] * a).sum(), (hidden, weight)
    )

    logits = (hidden @ weight.t())[None] / temperature  # [1, T, V]: today's obvious path
    ref_lp, ref_ent = token_logprobs(logits, targets[None])[0], token_entropy(logits)[0]
    ref_grads = torch.autograd.grad((ref_lp * a).sum() + (ref_ent * b).sum(), (hidden, weight))
    logits1 = (hidden @ weight.t())[None]
    ref_lp_only = torch.autograd.grad((token_logprobs(logits1, targets[None])[0] * a).sum(), (hidden, weight))

    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    for got, want in zip(grads + lp_only, ref_grads + ref_lp_only):
        assert float(want.abs().max()) > 0.1  # the comparison is not between two zeros
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_head_workspace_logsumexp_is_torch_s_bit_for_bit():
    # The workspace replays torch.logsumexp's own steps to keep its [C, V] difference out of a fresh
    # allocation; equality is exact (same ops, same order), including rows whose max is +-inf.
    from bandpo.actor.chunked import _Workspace

    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 301, generator=g) * 8
    z[0], z[1, 7], z[2, :50] = -float("inf"), float("inf"), -float("inf")
    got = _Workspace(6, torch.zeros(301, 4)).logsumexp(z.clone())
    assert torch.equal(got, torch.logsumexp(z, dim=-1))


# ---------------------------------------------------------------- packing helpers
def test_pack_rows_layout_and_unpack():
    rb = make_rollout(3, 0)
    packed = pack_rows(rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask)
    prompts, responses, _ = rb.to_lists()
    assert packed.input_ids[0].tolist() == [x for p, r in zip(prompts, responses) for x in p + r]
    assert packed.position_ids[0].tolist() == [
        i for p, r in zip(prompts, responses) for i in range(len(p) + len(r))
    ]
    # the hidden state at target_index is followed by the target token
    assert packed.input_ids[0, packed.target_index + 1].tolist() == packed.targets.tolist()
    flat = torch.arange(1.0, len(packed.targets) + 1)
    dense = unpack(flat, packed.response_mask)
    assert (
        dense[packed.response_mask].tolist() == flat.tolist()
        and float(dense[~packed.response_mask].abs().sum()) == 0
    )


def group_rollout(
    groups: int, n: int, seed: int, *, max_prompt: int = 9, max_response: int = 12
) -> RolloutBatch:
    """GRPO-shaped rows: ``groups`` random prompts, each answered by ``n`` random responses, the
    groups' rows interleaved (row i answers prompt i % groups) so that sharing must find them."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(
            3, 300, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g
        ).tolist()

    prompts = [ids(2, max_prompt) for _ in range(groups)]
    rows = groups * n
    responses = [ids(1, max_response) for _ in range(rows)]
    return RolloutBatch.from_lists(
        [prompts[i % groups] for i in range(rows)],
        responses,
        [[0.0] * len(r) for r in responses],
        [i % groups for i in range(rows)],
        ["stop"] * rows,
        pad_id=0,
    )


def test_shared_prompts_pack_each_prompt_once_and_targets_follow_their_own_row():
    rb = group_rollout(2, 3, seed=4)
    prompts, responses, _ = rb.to_lists()
    packed = pack_rows(rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask, share_prompts=True)
    # row 0: A r0 | row 1: B r1 | row 2: r2 (reads A) | row 3: r3 (reads B) | ...
    expected = prompts[0] + responses[0] + prompts[1] + responses[1] + [x for r in responses[2:] for x in r]
    assert packed.input_ids[0].tolist() == expected
    assert packed.position_ids[
        0, len(prompts[0]) + len(responses[0]) + len(prompts[1]) + len(responses[1]) :
    ].tolist() == [len(prompts[i % 2]) + j for i in range(2, 6) for j in range(len(responses[i]))]
    # the hidden state at target_index sits on the token before the target in the target's own row
    before = [
        ([*prompts[i % 2], *responses[i]])[len(prompts[i % 2]) - 1 + j]
        for i in range(6)
        for j in range(len(responses[i]))
    ]
    assert packed.input_ids[0, packed.target_index].tolist() == before
    assert packed.targets.tolist() == [x for r in responses for x in r]
    # unshared packing of the same rows: every prompt 3 times
    plain = pack_rows(rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask)
    assert plain.input_ids.shape[1] - packed.input_ids.shape[1] == 2 * (len(prompts[0]) + len(prompts[1]))
    assert prompt_keys(rb.prompt_ids, rb.prompt_mask) == [tuple(prompts[i % 2]) for i in range(6)]


def test_packed_budget_groups_keep_a_prompts_rows_together_within_budget():
    p_lens, r_lens = [10, 10, 10, 10, 20, 20], [5, 6, 7, 8, 3, 4]
    keys = ["a", "a", "a", "a", "b", "b"]
    # shared: a costs 10 + 26 = 36, b 20 + 7 = 27; a budget of 40 holds one unit each
    assert packed_budget_groups(p_lens, r_lens, 40, keys) == [[0, 1, 2, 3], [4, 5]]
    # a budget of 30 cuts a in row order: 10 + 5 + 6 + 7 = 28, then 10 + 8
    assert packed_budget_groups(p_lens, r_lens, 30, keys) == [[0, 1, 2], [4, 5], [3]]
    # unshared: rows cost p + r each (15, 16, 17, 18, 23, 24), first-fit decreasing into 40
    assert packed_budget_groups(p_lens, r_lens, 40) == [[1, 5], [2, 4], [0, 3]]


def test_packed_budget_groups_bound_the_attention_of_long_prompts_with_short_answers():
    """10 rows of one 100-token prompt with 1-token answers pack into 110 tokens, but their attention
    reads 10 x 101 positions: a pass keeps those within ATTENTION_BUDGET_FACTOR x budget (2 x 150),
    so pieces of 2 rows (202 positions; 3 would read 303), each its own pass (102 + 102 > 150)."""
    from bandpo.actor.packing import ATTENTION_BUDGET_FACTOR

    assert ATTENTION_BUDGET_FACTOR == 2
    groups = packed_budget_groups([100] * 10, [1] * 10, 150, ["a"] * 10)
    assert sorted(groups) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    # with room for the attention, the same rows share one pass
    assert packed_budget_groups([100] * 10, [1] * 10, 600, ["a"] * 10) == [list(range(10))]


def test_shared_prompt_forward_equals_padded_forward(tiny_model_dir):
    """Log-probs through the layout of shared prompts equal the padded forward's logits at every target."""
    from transformers import AutoModelForCausalLM

    from bandpo.actor.attention import LAYOUT_KW, use_packed_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert use_packed_attention(model)
    rb = group_rollout(3, 4, seed=9)
    p_ids, p_mask, r_ids, r_mask = trim_padding(
        rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask
    )
    packed = pack_rows(p_ids, p_mask, r_ids, r_mask, share_prompts=True)
    with torch.no_grad():
        # padded: [n, r, V]
        padded = model(**model_inputs(p_ids, p_mask, r_ids, r_mask)).logits[:, p_ids.shape[1] - 1 : -1]
        flat = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **{LAYOUT_KW: packed.layout},
        ).logits[0, packed.target_index]
    torch.testing.assert_close(flat, padded[r_mask.bool()], atol=1e-5, rtol=0)


def test_budget_groups_cover_rows_once_within_budget_and_split_to_count():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 300, (40,), generator=g).tolist()
    groups = packed_budget_groups(lengths, [0] * 40, 400)
    assert sorted(i for grp in groups for i in grp) == list(range(40))
    assert all(sum(lengths[i] for i in grp) <= 400 for grp in groups)
    assert len(groups) <= -(-sum(lengths) // 400) + 5  # first-fit decreasing packs tightly
    assert packed_budget_groups([500, 10], [0, 0], 400) == [[0], [1]]  # an over-budget row goes alone
    more = split_to_count(groups, lengths, len(groups) + 3)
    assert len(more) == len(groups) + 3 and sorted(i for grp in more for i in grp) == list(range(40))
    with pytest.raises(ValueError, match="cannot make"):
        split_to_count([[0], [1]], [5, 5], 3)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "packed"])
def test_packed_forward_equals_padded_forward(tiny_model_dir, attn):
    """transformers separates packed rows from position ids restarting at 0 (no attention mask,
    no KV cache); so does bandpo's row-wise attention, which leaves padded batches to sdpa."""
    from transformers import AutoModelForCausalLM

    from bandpo.actor.attention import NAME, use_packed_attention

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa" if attn == "packed" else attn
    )
    rb = make_rollout(5, 7)
    p_ids, p_mask, r_ids, r_mask = trim_padding(
        rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask
    )
    packed = pack_rows(p_ids, p_mask, r_ids, r_mask)
    kw = dict(input_ids=packed.input_ids, position_ids=packed.position_ids)
    with torch.no_grad():
        # padded: [n, r, V]
        padded = model(**model_inputs(p_ids, p_mask, r_ids, r_mask)).logits[:, p_ids.shape[1] - 1 : -1]
        with_cache = model(**kw, use_cache=True).logits[0, packed.target_index]
        if attn == "packed":
            use_packed_attention(model)
            assert model.config._attn_implementation == NAME
            padded_again = model(**model_inputs(p_ids, p_mask, r_ids, r_mask)).logits[
                :, p_ids.shape[1] - 1 : -1
            ]
            torch.testing.assert_close(padded_again, padded, atol=1e-6, rtol=0)
        flat = model(**kw, use_cache=False).logits[0, packed.target_index]
    torch.testing.assert_close(flat, padded[r_mask.bool()], atol=1e-5, rtol=0)
    # with a KV cache transformers does not look for packed rows: rows would attend across boundaries
    assert float((with_cache - flat).abs().max()) > 1e-2


# ---------------------------------------------------------------- config keys
@pytest.mark.parametrize(
    "overrides,key",
    [
        (["actor.reuse_old_logprobs=maybe"], "actor.reuse_old_logprobs"),
        (
            ["actor.reuse_old_logprobs=true", "algorithm=bandpo", "algorithm.band.adaptive=entropy"],
            "actor.reuse_old_logprobs",
        ),  # the batch entropy scale needs every row's pi_old entropy first
        (["actor.padding_free=false"], "actor.max_tokens_per_micro_batch"),
        (["actor.padding_free=maybe"], "actor.padding_free"),
        (["actor.logits_chunk_tokens=0"], "actor.logits_chunk_tokens"),
        (["actor.logprob_head=fused"], "actor.logprob_head"),
        (["model.fp32_head=maybe"], "model.fp32_head"),
        (["model.fp32_head=true", "rollout=hf"], "model.fp32_head"),  # the HF engine has no float32 head
        (
            ["model.fp32_head=true", "actor.padding_free=false", "actor.max_tokens_per_micro_batch=0"]
            + ["actor.share_prompts=false"],
            "model.fp32_head",
        ),  # the padded path's logits are the model's own lm_head's
        (["actor.max_tokens_per_micro_batch=-1"], "actor.max_tokens_per_micro_batch"),
        (["actor.share_prompts=maybe"], "actor.share_prompts"),
        (["actor.collective_timeout_min=0"], "actor.collective_timeout_min"),
        (["actor.padding_free=false", "actor.max_tokens_per_micro_batch=0"], "actor.share_prompts"),
    ],
)
def test_actor_config_keys_are_validated(overrides, key):
    from bandpo.config import compose
    from bandpo.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        compose(overrides)


def test_reuse_old_logprobs_applies_except_for_the_batch_entropy_scale():
    from bandpo.config import compose, reuse_old_logprobs

    several_steps = ["trainer.prompts_per_step=16", "actor.mini_batch_prompts=8"]
    assert reuse_old_logprobs(compose(several_steps))
    assert reuse_old_logprobs(compose(several_steps + ["actor.epochs=2", "actor.reuse_old_logprobs=true"]))
    assert not reuse_old_logprobs(compose(several_steps + ["actor.reuse_old_logprobs=false"]))
    adaptive = ["algorithm=bandpo", "algorithm.band.adaptive=entropy"]
    assert not reuse_old_logprobs(compose(adaptive))  # batch scale: the separate pass over every row
    assert reuse_old_logprobs(compose(adaptive + ["algorithm.band.adaptive_norm=logv"]))
    padded = ["actor.padding_free=false", "actor.max_tokens_per_micro_batch=0", "actor.share_prompts=false"]
    assert compose(padded).actor.padding_free is False


def test_packed_attention_matches_per_row_reference_without_slice_backward():
    """Row-wise attention vs one causal SDPA per row by hand (with grads), and its graph holds no
    SliceBackward: slicing rows out of [1, heads, T, d] costs a zero-filled T-sized gradient per
    row in backward (rows x T work: a 512-row micro-batch took 19 s instead of 1 s)."""
    from types import SimpleNamespace

    from bandpo.actor.attention import _attention

    g = torch.Generator().manual_seed(0)
    lens = [3, 1, 5, 4]
    q = torch.randn(1, 4, sum(lens), 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, sum(lens), 8, generator=g, requires_grad=True)  # grouped-query: 2 kv heads
    v = torch.randn(1, 2, sum(lens), 8, generator=g, requires_grad=True)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    out, _ = _attention(SimpleNamespace(training=False), q, k, v, None, scaling=0.3, position_ids=pos)

    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack += [f for f, _ in fn.next_functions]
    assert "SliceBackward0" not in names, names

    ref, s = [], 0
    for n in lens:  # the obvious reference: softmax(q k^T * scale + causal) v, row by row
        qi, ki, vi = (
            q[0, :, s : s + n],
            k[0, :, s : s + n].repeat_interleave(2, 0),
            v[0, :, s : s + n].repeat_interleave(2, 0),
        )
        scores = (qi @ ki.transpose(-1, -2)) * 0.3 + torch.full((n, n), float("-inf")).triu(1)
        ref.append((scores.softmax(-1) @ vi).transpose(0, 1))  # [n, heads, d]
        s += n
    ref = torch.cat(ref)[None]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    w = torch.randn(out.shape, generator=g)
    got, want = (
        torch.autograd.grad((out * w).sum(), (q, k, v)),
        torch.autograd.grad((ref * w).sum(), (q, k, v)),
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# Ops that make the host wait for the device: a boolean mask's selected count (nonzero,
# masked_select), a scalar read (item).
SYNCING_OPS = {"nonzero", "masked_select", "_local_scalar_dense", "item", "is_nonzero"}


def _attention_run(layout, q, k, v, w):
    """Forward + backward of the packed attention with ``layout``, recording every aten op (and
    whether an indexing op got a boolean index)."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from bandpo.actor.attention import LAYOUT_KW, _attention

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
            bool_index = any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat[1:])
            self.ops.append((func.overloadpacket.__name__, bool_index))
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        out, _ = _attention(
            SimpleNamespace(training=True),
            q,
            k,
            v,
            None,
            scaling=0.3,
            position_ids=torch.zeros(1, q.shape[2], dtype=torch.long),
            **{LAYOUT_KW: layout},
        )
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out, grads, rec.ops


def test_packed_attention_indexes_without_masks_and_equals_the_masked_formulation():
    """The layout's index tensors replace boolean-mask indexing (a device -> host sync per bucket
    per layer on GPU): forward and backward run no op that reads device values on the host, and
    give exactly (bit for bit: a gather picks the same elements) what selecting each bucket's
    written columns with a boolean mask and reordering gave."""
    from bandpo.actor.attention import build_layout, length_buckets

    # Attention rows (start1, len1, start2, len2, write_from) of 23 packed tokens: prompt A (3) +
    # response (4); a response (2) reading A; prompt B (5) + response (1); a response (6) reading
    # B; a plain row (2). Lengths 7, 5, 6, 11, 2: four buckets, two rows leave columns unwritten.
    rows = torch.tensor(
        [[0, 7, 7, 0, 0], [0, 3, 7, 2, 3], [9, 6, 15, 0, 0], [9, 5, 15, 6, 5], [21, 2, 23, 0, 0]]
    )
    t = 23
    layout = build_layout(rows, t)
    assert len(layout.buckets) == 4
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, t, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, t, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, t, 8, generator=g, requires_grad=True)
    w = torch.randn(1, t, 4, 8, generator=g)
    out, grads, ops = _attention_run(layout, q, k, v, w)
    assert not {name for name, _ in ops} & SYNCING_OPS, sorted({name for name, _ in ops})
    assert not [name for name, b in ops if b and name.startswith("index")]

    # The masked formulation: per bucket, boolean-select the written columns (write_from ..
    # length), then put them into packed order.
    _, l1, _, l2, wf = rows.unbind(-1)
    length = l1 + l2
    parts, dest = [], []
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))
    for index, members in zip(layout.buckets, length_buckets(length.tolist())):
        m = torch.tensor(members)
        col = torch.arange(index.shape[1])[None]
        write = (col >= wf[m, None]) & (col < length[m, None])
        qb, kb, vb = (x[index].transpose(1, 2) for x in (qt, kt, vt))
        kb, vb = kb.repeat_interleave(2, dim=1), vb.repeat_interleave(2, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=0.3)
        parts.append(o.transpose(1, 2)[write])
        dest.append(index[write])
    ref = torch.cat(parts)[torch.cat(dest).argsort()][None]
    assert torch.equal(out, ref)
    for a, b in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_packed_attention_makes_no_device_sync_on_gpu():
    """On CUDA, forward and backward of the packed attention with a layout already on the device
    never wait for the device (torch raises on any synchronising call in this mode)."""
    from bandpo.actor.attention import build_layout

    rows = torch.tensor(
        [[0, 7, 7, 0, 0], [0, 3, 7, 2, 3], [9, 6, 15, 0, 0], [9, 5, 15, 6, 5], [21, 2, 23, 0, 0]]
    )
    layout = build_layout(rows, 23).to("cuda")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 23, 8, generator=g).cuda().requires_grad_() for h in (4, 2, 2))
    w = torch.randn(1, 23, 4, 8, generator=g).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, grads, _ = _attention_run(layout, q, k, v, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (1, 23, 4, 8) and all(gr.is_cuda for gr in grads)
