"""Offload during rollout on a CUDA GPU: the real DeepSpeed 0.19 ``offload_states`` / ``reload_states``
and this project's own moves, under ZeRO-2 and ZeRO-3 with a reference model.

Runs in a subprocess with ``DS_ACCELERATOR=cuda`` (conftest pins DeepSpeed's accelerator to the
CPU for every other test in this process). An actor that offloads between its stages must train
as one that does not (same seed, same batches; up to the GPU kernels' summation order), hold less
GPU memory while offloaded, none of it cached, and save a checkpoint from host memory that an
offloaded actor loads exactly (a resume).
"""

from __future__ import annotations

import pytest

from tests.helpers.actor import run_cuda_check

pytestmark = [pytest.mark.integration, pytest.mark.gpu]

CHECK = r"""
import json, sys, tempfile
import torch
from tests.helpers.actor import BANDPO, full_weights, make_rollout, max_diff
from bandpo.actor import Actor
from bandpo.types import TrainBatch

model_dir, out = sys.argv[1], {}
rb = make_rollout(8, 5)
gib = float(1 << 30)
for stage in (2, 3):
    runs = {}
    for offload in (False, True):
        actor = Actor(model_dir, zero_stage=stage, bf16=True, mini_batch_size=8, micro_batch_size=4, lr=1e-3,
                      weight_decay=0.0, ref_model=True, offload_during_rollout=offload, seed=0)
        mem = {"start": torch.cuda.memory_allocated() / gib}
        for step in range(2):
            actor.reload()  # the engines sleep
            mem[f"reloaded{step}"] = torch.cuda.memory_allocated() / gib
            old, _ = actor.compute_logprobs(rb)
            ref, _ = actor.compute_logprobs(rb, ref=True)
            batch = TrainBatch.from_rollout(rb, advantages=torch.ones(8), old_logprobs=old, ref_logprobs=ref)
            actor.update(batch, BANDPO)
            actor.offload()  # the engines wake
            mem[f"offloaded{step}"] = torch.cuda.memory_allocated() / gib
            mem[f"cached{step}"] = (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / gib
        states = actor.engine.optimizer.optimizer.state.values()
        adam = sorted({v.device.type for s in states for v in s.values() if torch.is_tensor(v) and v.dim() > 0})
        if offload:  # a checkpoint saved from host memory loads into an offloaded actor (a resume)
            folder = tempfile.mkdtemp()
            actor.save_checkpoint(folder)
            restored = Actor(model_dir, zero_stage=stage, bf16=True, mini_batch_size=8, micro_batch_size=4,
                             lr=1e-3, weight_decay=0.0, ref_model=True, offload_during_rollout=True, seed=1)
            restored.load_checkpoint(folder)
            restored.reload()
            restored_weights = full_weights(restored)
            del restored
        actor.reload()
        v_sum = float(sum(s["exp_avg_sq"].double().sum() for s in states))  # Adam's second moments, all ranks' share
        runs[offload] = (full_weights(actor), mem, adam, v_sum)
        del actor
        torch.cuda.empty_cache()
    out[stage] = {"weight_diff": max_diff(runs[False][0], runs[True][0]), "mem": runs[True][1],
                  "restored_diff": max_diff(runs[True][0], restored_weights),
                  "mem_without": runs[False][1], "adam_devices_offloaded": runs[True][2],
                  "v_sums": [runs[False][3], runs[True][3]]}
print("RESULT " + json.dumps(out))
"""


def test_offloaded_actor_trains_like_a_resident_one_and_leaves_the_gpu(tiny_model_dir):
    result = run_cuda_check(CHECK, tiny_model_dir)
    for stage, r in result.items():
        print(stage, r)
        # Moving a tensor to the host and back is exact, so both runs take the same two AdamW steps up to
        # GPU kernels' summation order (atomics in backward): weights within a bf16 ulp of 0.02-sized
        # weights (1e-4) plus 2 lr per step for entries whose gradient is within that noise of zero.
        assert r["weight_diff"] < 2 * 1e-3 * 2 + 1e-4, (stage, r)
        # State lost or mixed up in the moves would change Adam's second moments by far more than that noise.
        assert r["v_sums"][1] == pytest.approx(r["v_sums"][0], rel=1e-2), (stage, r)
        assert r["adam_devices_offloaded"] == ["cpu"], (stage, r)
        assert r["restored_diff"] == 0.0, (stage, r)  # a checkpoint round trip is exact
        mem = r["mem"]
        for step in range(2):
            assert mem[f"offloaded{step}"] < mem[f"reloaded{step}"], (stage, r)
            assert mem[f"cached{step}"] < 0.05, (stage, r)  # empty_cache gave the free blocks back
