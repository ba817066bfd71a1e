"""The DeepSpeed actor on a CUDA GPU: bf16 weights with fp32 master weights, NCCL, ZeRO-2 and ZeRO-3.

Runs in a subprocess with ``DS_ACCELERATOR=cuda``: conftest pins DeepSpeed's accelerator (a
process-wide choice) to the CPU for every other test in this process.
"""

from __future__ import annotations

import pytest

from tests.helpers.actor import run_cuda_check

pytestmark = [pytest.mark.integration, pytest.mark.gpu]

CHECK = r"""
import json, sys
import torch
from tests.helpers.actor import BANDPO, full_weights, make_rollout, masked_mean_per_row, plain_hf_logprobs
from bandpo.actor import Actor
from bandpo.types import TrainBatch

model_dir, out = sys.argv[1], {}
rb = make_rollout(8, 5)
mask = rb.response_mask.float()
reference = plain_hf_logprobs(model_dir, rb)  # fp32 on the CPU
for stage in (2, 3):
    actor = Actor(model_dir, zero_stage=stage, bf16=True, mini_batch_size=8, micro_batch_size=4, lr=1e-3,
                  weight_decay=0.0)
    old, ent = actor.compute_logprobs(rb, with_entropy=True)
    batch = TrainBatch.from_rollout(rb, advantages=torch.ones(8), old_logprobs=old)
    metrics = actor.update(batch, BANDPO)
    new, _ = actor.compute_logprobs(rb)
    weights = full_weights(actor)
    out[stage] = {
        "device": str(actor.device),
        "logprob_err": float(((old - reference).abs() * mask).sum() / mask.sum()),
        "rise": masked_mean_per_row(new - old, mask).tolist(),
        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
        "dtypes": sorted({str(t.dtype) for t in weights.values()}),
        "finite": all(bool(torch.isfinite(t).all()) for t in weights.values()),
        "entropy_ok": bool((ent[rb.response_mask == 1] > 0).all()),
    }
print("RESULT " + json.dumps(out))
"""


def test_bf16_actor_on_cuda_updates_under_zero2_and_zero3(tiny_model_dir):
    result = run_cuda_check(CHECK, tiny_model_dir)
    for stage, r in result.items():
        assert r["device"].startswith("cuda"), (stage, r)
        # bf16 weights and activations: logprobs agree with the fp32 reference to bf16 precision.
        assert r["logprob_err"] < 0.01, (stage, r)  # H100: 1.2e-3
        # ratio 1 before the step: loss = -mean A
        assert r["loss"] == pytest.approx(-1.0, abs=1e-3), (stage, r)
        assert r["grad_norm"] > 0 and r["finite"] and r["entropy_ok"], (stage, r)
        assert all(d > 0 for d in r["rise"]), (stage, r)  # positive advantage raises every row's logprobs
