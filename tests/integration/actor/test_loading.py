"""Two actor ranks (Ray actors, gloo) build their model and reference model without whole copies
(partitioned under ZeRO-3, streamed per tensor under ZeRO-2): the weights every rank ends with
are exactly ``from_pretrained``'s, as when every rank loaded the whole model.
"""

from __future__ import annotations

import pytest
import torch

from bandpo.actor import ActorGroup
from tests.unit.actor.test_loading import reference, save_qwen2

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_load_exactly_the_checkpoint(ray_local, tiny_model_dir, zero_stage):
    def fetch(actor):  # nested: Ray pickles it by value; all ranks at once (ZeRO-3 gathers are collective)
        import deepspeed

        out = {"actor": {name: t for bucket in actor.named_weights() for name, t in bucket}}
        ref = actor.ref.module if actor.zero_stage == 3 else actor.ref
        params = list(ref.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=actor.zero_stage == 3):
            out["ref"] = {name: p.detach().cpu().clone() for name, p in params}
        partitions = (
            [p.ds_tensor.numel() for p in actor.engine.module.parameters()] if actor.zero_stage == 3 else []
        )
        return out, partitions

    want = dict(reference(tiny_model_dir, torch.float32).named_parameters())
    group = ActorGroup(
        tiny_model_dir, 2, zero_stage=zero_stage, mini_batch_size=2, micro_batch_size=1, ref_model=True
    )
    try:
        ranks = ray_local.get([w.__ray_call__.remote(fetch) for w in group.workers])
    finally:
        group.shutdown()
    for weights, partitions in ranks:
        for model in ("actor", "ref"):
            assert weights[model].keys() == want.keys()
            for name, t in weights[model].items():
                assert torch.equal(t, want[name].detach()), (model, name)
        if zero_stage == 3:  # each rank keeps half of every parameter (rounded up)
            assert partitions == [(p.numel() + 1) // 2 for p in want.values()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero3_build_keeps_the_dtypes_of_from_pretrained(tmp_path, dtype):
    """Built inside zero.Init (one rank): parameters in the training dtype, the rotary frequencies
    (buffers the model computes in fp32) still fp32 and equal, as from_pretrained makes them; an
    untied bf16 checkpoint, so the cast and both heads are covered."""
    import deepspeed

    from bandpo.actor.ds_config import build_ds_config
    from bandpo.actor.loading import load_model
    from bandpo.actor.setup import init_distributed

    init_distributed(0, 1, 0, "127.0.0.1", None, "gloo")
    path = save_qwen2(tmp_path, tied=False, dtype=torch.bfloat16)
    config = build_ds_config(
        zero_stage=3,
        micro_batch_size=1,
        grad_accum=1,
        world_size=1,
        grad_clip=1.0,
        bf16=dtype == torch.bfloat16,
    )
    model, want = load_model(path, dtype, "cpu", config), reference(path, dtype)
    buffers = dict(want.named_buffers())
    for name, buf in model.named_buffers():
        assert buf.dtype == buffers[name].dtype == torch.float32 and torch.equal(buf, buffers[name]), name
    params, expected = list(model.named_parameters()), dict(want.named_parameters())
    assert [n for n, _ in params] == list(expected)
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        for name, p in params:
            assert p.dtype == dtype and torch.equal(p, expected[name]), name
