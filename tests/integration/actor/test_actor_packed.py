"""Padding-free actor through DeepSpeed: packed vs padded updates, old log-probs from the
update's own forward, bounded memory at V = 151,936. The forwards and packing helpers without
DeepSpeed are in tests/unit/actor/test_actor_packed.py (tolerances explained there).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest
import torch

from bandpo.types import TrainBatch
from tests.helpers.actor import BANDPO, full_weights, make_rollout, make_train_batch, max_diff, new_actor
from tests.helpers.models import tiny_qwen2
from tests.unit.actor.test_actor_packed import group_rollout

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------- through the DeepSpeed actor
def test_packed_update_equals_padded_update(tiny_model_dir):
    """Token-budget micro-batches (several per step, uneven) + entropy bonus + KL vs the padded path
    with 2-row micro-batches: same loss, metrics and weights (tied embeddings: the lm_head's
    gradient reaches the shared weight), with either lm_head (online, chunked). Gradient checkpointing
    changes nothing either."""
    loss_options = replace(BANDPO, kl_coef=0.01, entropy_coef=0.01)
    runs = {}
    for name, kw in {
        "padded": dict(padding_free=False),
        "packed": dict(max_tokens_per_micro_batch=40, logits_chunk_tokens=7),  # the online head on CPU
        "packed_chunked": dict(max_tokens_per_micro_batch=40, logits_chunk_tokens=7, logprob_head="chunked"),
        "packed_ckpt": dict(
            max_tokens_per_micro_batch=40, logits_chunk_tokens=7, gradient_checkpointing=True
        ),
    }.items():
        actor = new_actor(tiny_model_dir, mini_batch_size=4, ref_model=True, **kw)
        batch = make_train_batch(actor, 8, seed=61)
        lp, ent = actor.compute_logprobs(batch, with_entropy=True)
        batch.ref_logprobs = actor.compute_logprobs(batch, ref=True)[0]
        metrics = actor.update(batch, loss_options)
        runs[name] = (lp, ent, metrics, full_weights(actor))
    lp, ent, m, w = runs["padded"]
    assert max_diff(w, full_weights(new_actor(tiny_model_dir))) > 1e-4  # the update did something
    for name in ("packed", "packed_chunked", "packed_ckpt"):
        lp2, ent2, m2, w2 = runs[name]
        torch.testing.assert_close(lp2, lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent2, ent, atol=1e-5, rtol=0)
        assert max_diff(w, w2) < 1e-5, name
        for key in ("loss", "pg_loss", "entropy", "kl_ref", "grad_norm", "clip_frac_up", "num_tokens"):
            assert m2[key] == pytest.approx(m[key], rel=1e-5, abs=1e-6), (name, key)


def test_shared_prompt_update_equals_padded_update(tiny_model_dir):
    """GRPO-shaped batch (4 prompts x 4 responses, interleaved), two optimizer steps, KL + entropy
    bonus: shared-prompt packing (a budget that cuts some groups, and one that holds whole mini-
    batches) gives the padded path's log-probs, entropies, ref log-probs, metrics and weights."""
    loss_options = replace(BANDPO, kl_coef=0.01, entropy_coef=0.01)
    g = torch.Generator().manual_seed(5)
    rb = group_rollout(4, 4, seed=23)
    adv = torch.randn(16, generator=g)
    runs = {}
    for name, kw in {
        "padded": dict(padding_free=False),
        "shared_cut": dict(max_tokens_per_micro_batch=30, logprob_token_budget=30, logits_chunk_tokens=7),
        "shared": dict(max_tokens_per_micro_batch=1000),
    }.items():
        actor = new_actor(tiny_model_dir, mini_batch_size=8, ref_model=True, **kw)
        assert actor.share_prompts == (name != "padded")
        lp, ent = actor.compute_logprobs(rb, with_entropy=True)
        ref = actor.compute_logprobs(rb, ref=True)[0]
        old = (lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))).clamp(max=-1e-3)
        batch = TrainBatch.from_rollout(
            rb, advantages=adv, old_logprobs=old * rb.response_mask, ref_logprobs=ref
        )
        runs[name] = (lp, ent, ref, actor.update(batch, loss_options), full_weights(actor))
    lp, ent, ref, m, w = runs["padded"]
    assert max_diff(w, full_weights(new_actor(tiny_model_dir))) > 1e-4  # the update did something
    for name in ("shared_cut", "shared"):
        lp2, ent2, ref2, m2, w2 = runs[name]
        for got, want in ((lp2, lp), (ent2, ent), (ref2, ref)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert max_diff(w, w2) < 1e-5, name
        for key in ("loss", "pg_loss", "entropy", "kl_ref", "grad_norm", "clip_frac_up", "num_tokens"):
            assert m2[key] == pytest.approx(m[key], rel=1e-5, abs=1e-6), (name, key)


@pytest.mark.parametrize("mini_batch_size", [8, 4])
def test_update_on_policy_equals_separate_old_logprob_pass(tiny_model_dir, mini_batch_size):
    """The first optimizer step's old log-probs taken from its own forward give the same update as a
    separate no-grad pass over every row, and the same old log-probs and entropy back for that
    step's rows: with one optimizer step (8 rows) and with two (4 + 4, the later rows' old
    log-probs from the batch; the first rows' there are placeholders the update must not read)."""
    g = torch.Generator().manual_seed(3)
    rb = make_rollout(8, 71)
    adv = torch.randn(8, generator=g)
    first = mini_batch_size
    full = new_actor(tiny_model_dir, max_tokens_per_micro_batch=50, mini_batch_size=mini_batch_size)
    old, ent = full.compute_logprobs(rb, with_entropy=True)
    m_full = full.update(TrainBatch.from_rollout(rb, advantages=adv, old_logprobs=old), BANDPO)

    skip = new_actor(tiny_model_dir, max_tokens_per_micro_batch=50, mini_batch_size=mini_batch_size)
    later = None
    if first < 8:
        later = old.clone()
        later[:first] = 5.0  # a placeholder far from any log-prob: read, it would change the step
    m_skip, old_skip, ent_skip = skip.update_on_policy(
        TrainBatch.from_rollout(rb, advantages=adv, old_logprobs=later), BANDPO
    )
    torch.testing.assert_close(old_skip[:first], old[:first], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_skip[:first], ent[:first], atol=1e-5, rtol=0)
    assert not old_skip[first:].any() and not ent_skip[first:].any()
    assert max_diff(full_weights(full), full_weights(skip)) < 1e-5
    for key in ("loss", "grad_norm", "entropy", "approx_kl", "clip_frac_up", "clip_frac_down"):
        assert m_skip[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-6), key
    if first == 8:
        assert m_skip["clip_frac_up"] == m_skip["clip_frac_down"] == 0.0  # ratio == 1 exactly
    else:  # two steps need the later rows' old log-probs
        with pytest.raises(ValueError, match="old_logprobs"):
            skip.update_on_policy(TrainBatch.from_rollout(rb, advantages=adv), BANDPO)


# ---------------------------------------------------------------- memory at the real vocabulary
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_during(fn) -> tuple[int, object]:
    """Peak resident memory (sampled every 2 ms) while ``fn`` runs, and its result."""
    peak, done = [_rss_bytes()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], _rss_bytes()), result


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
def test_logprob_pass_and_update_memory_bounded_at_real_vocab(tmp_path):
    """V = 151,936, 4 rows x (32 + 224) tokens = 1,024 tokens: the padded path's float32 logits
    alone are 1,024 x 151,936 x 4 B = 622 MB (and its entropy softmax as much again). With the
    chunked head's 64-token chunks one [chunk, V] buffer is 39 MB; forward holds 2 and backward 3 of
    them (the online head, the default on CPU, holds three [64, 1,024] tiles instead),
    plus the lm_head gradient (39 MB) and Adam's state (2 x 39 MB, first step): < 300 MB."""
    vocab = 151_936
    tiny_qwen2(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=1,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    actor = new_actor(
        str(tmp_path), mini_batch_size=4, max_tokens_per_micro_batch=1024, logits_chunk_tokens=64
    )
    g = torch.Generator().manual_seed(0)
    from bandpo.types import RolloutBatch

    rb = RolloutBatch.from_lists(
        torch.randint(3, vocab, (4, 32), generator=g).tolist(),
        torch.randint(3, vocab, (4, 224), generator=g).tolist(),
        [[0.0] * 224] * 4,
        list(range(4)),
        ["length"] * 4,
        pad_id=0,
    )
    base = _rss_bytes()
    peak_lp, (old, _) = _peak_rss_during(lambda: actor.compute_logprobs(rb, with_entropy=True))
    batch = TrainBatch.from_rollout(rb, advantages=torch.randn(4, generator=g), old_logprobs=old)
    peak_up, _ = _peak_rss_during(lambda: actor.update(batch, BANDPO))
    extra_mb = (max(peak_lp, peak_up) - base) / 2**20
    assert extra_mb < 300, f"extra peak {extra_mb:.0f} MB (log-probs {(peak_lp - base) / 2**20:.0f} MB)"
