"""The DeepSpeed actor in bf16 on CPU: DeepSpeed's bf16 mode on its CPU accelerator (bf16 weights, fp32
master weights and gradient accumulation), ZeRO-2 and ZeRO-3, one rank here and two as Ray actors over gloo.

Kept tiny (a few dozen tokens): on a CPU without AVX512-BF16 / AMX PyTorch emulates bf16 matmuls, 100x
slower than fp32. The log-prob bound is derived in tests/unit/actor/test_bf16_logprobs.py.
"""

from __future__ import annotations

import pytest
import torch

from bandpo.actor import ActorGroup
from bandpo.types import TrainBatch
from tests.helpers.actor import (
    BANDPO,
    bf16_logprob_bound,
    full_weights,
    make_rollout,
    masked_mean_per_row,
    max_diff,
    new_actor,
    plain_hf_logprobs,
)

pytestmark = pytest.mark.integration


def _master_and_adam_dtypes(actor) -> set[torch.dtype]:
    """dtypes of the ZeRO optimizer's master weights (ZeRO-2 / ZeRO-3 name them differently) and Adam's moments."""
    opt = actor.engine.optimizer
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
    moments = [
        t for state in opt.optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()
    ]
    return {t.dtype for t in [*masters, *moments]}


def _masters(actor) -> dict[str, torch.Tensor]:
    """The ZeRO optimizer's fp32 master copy of every parameter, whole (a collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).cpu() for n, p in actor.engine.module.named_parameters()}


def _check_masters_are_the_checkpoints(masters: dict[str, torch.Tensor], model_dir: str) -> None:
    """The masters hold the float32 checkpoint's values bit for bit, not their bf16 rounding (which
    differs: a random init uses all 23 mantissa bits)."""
    from safetensors.torch import load_file

    from bandpo.actor.loading import weight_files

    saved = {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}
    assert {v.dtype for v in saved.values()} == {torch.float32}
    shared = masters.keys() & saved.keys()
    assert shared == masters.keys()  # every parameter is in the file (tied weights under their first name)
    for name in shared:
        assert torch.equal(masters[name], saved[name]), name
    assert any(not torch.equal(saved[n].bfloat16().float(), saved[n]) for n in shared)


def _step_with_advantage_one(run, rb):
    """``run(method, *args)`` on an actor or a group: old log-probs, one update with A = 1, new log-probs."""
    old, ent = run("compute_logprobs", rb, True)
    metrics = run(
        "update", TrainBatch.from_rollout(rb, advantages=torch.ones(rb.size), old_logprobs=old), BANDPO
    )
    new, _ = run("compute_logprobs", rb, False)
    return old, ent, metrics, new


def _check_step(step, rb, model_dir: str):
    """``step``: ``_step_with_advantage_one``'s outputs for ``rb`` with the model in ``model_dir``."""
    old, ent, metrics, new = step
    mask = rb.response_mask.float()
    bound, _ = bf16_logprob_bound(model_dir, rb)
    err = float(((old - plain_hf_logprobs(model_dir, rb)).abs() * mask).max())  # against fp32
    assert 0 < err <= bound, (err, bound)  # > 0: it did compute in bf16
    assert bool((ent[rb.response_mask == 1] > 0).all())
    # ratio 1 before the step, up to bf16 differences between the log-prob pass's and the update's packing
    assert metrics["loss"] == pytest.approx(-1.0, abs=0.05) and metrics["nonfinite_steps"] == 0
    assert metrics["grad_norm"] > 0
    assert bool((masked_mean_per_row(new - old, mask) > 0).all())  # A > 0 raised every row's log-probs


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_bf16_actor_on_cpu_trains_with_fp32_master_weights(tiny_model_dir, zero_stage):
    rb = make_rollout(6, 3)
    actor = new_actor(
        tiny_model_dir, zero_stage=zero_stage, bf16=True, mini_batch_size=6, micro_batch_size=3, lr=1e-3
    )
    assert actor.on_cpu
    _check_masters_are_the_checkpoints(_masters(actor), tiny_model_dir)
    _check_step(_step_with_advantage_one(lambda name, *a: getattr(actor, name)(*a), rb), rb, tiny_model_dir)
    assert {t.dtype for t in full_weights(actor).values()} == {torch.bfloat16}
    assert _master_and_adam_dtypes(actor) == {torch.float32}
    actor.close()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_bf16_ranks_reduce_over_gloo_and_stay_equal(ray_local, tiny_model_dir, zero_stage):
    import ray

    rb = make_rollout(8, 3)
    group = ActorGroup(
        tiny_model_dir,
        2,
        zero_stage=zero_stage,
        bf16=True,
        mini_batch_size=8,
        micro_batch_size=2,
        lr=1e-3,
        weight_decay=0.0,
    )
    try:
        # each rank set its own partition of the masters, the last one padded under ZeRO-3
        for masters in ray.get([w.__ray_call__.remote(_masters) for w in group.workers]):
            _check_masters_are_the_checkpoints(masters, tiny_model_dir)
        # each rank reported its device and precision at start (bandpo.actor.rank_device), checked against the plan
        assert [(r["rank"], r["accelerator"], r["device"], r["precision"]) for r in group.reports] == [
            (rank, "cpu", "cpu", "computes in bfloat16, weights bfloat16") for rank in (0, 1)
        ]

        def run(name, *args):
            return (
                group.update_epoch(*args)
                if name == "update"
                else group.compute_logprobs(args[0], with_entropy=args[1])
            )

        _check_step(_step_with_advantage_one(run, rb), rb, tiny_model_dir)
        # All ranks at once: under ZeRO-3 every bucket is a gather (of bf16 partitions, over gloo).
        fetch = lambda actor: {n: t for bucket in actor.named_weights() for n, t in bucket}  # noqa: E731
        rank0, rank1 = ray.get([w.__ray_call__.remote(fetch) for w in group.workers])
        # the same reduced gradients, the same fp32 step, the same rounding
        assert max_diff(rank0, rank1) == 0.0
        assert {t.dtype for t in rank0.values()} == {torch.bfloat16}
    finally:
        group.shutdown()
