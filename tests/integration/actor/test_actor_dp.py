"""Two data-parallel actor ranks (Ray actors, gloo) against one in-process rank on the same batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bandpo.actor import ActorGroup
from bandpo.actor.setup import cpu_threads_per_rank
from bandpo.types import TrainBatch
from tests.helpers.actor import (
    BANDPO,
    COMPARED_METRICS,
    assert_same_adam_weights,
    full_weights,
    make_rollout,
    max_diff,
    new_actor,
    rank_weights,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_equal_one_rank(ray_local, tiny_model_dir, tmp_path, zero_stage):
    # A small token budget gives the ranks different numbers of no-grad passes, which under
    # ZeRO-3 must still line up (dummy passes).
    kw = {
        "zero_stage": zero_stage,
        "mini_batch_size": 8,
        "micro_batch_size": 2,
        "logprob_token_budget": 40,
        "ref_model": True,
    }
    loss_options = replace(BANDPO, kl_coef=0.01)
    rb = make_rollout(16, seed=51)
    g = torch.Generator().manual_seed(52)

    single = new_actor(tiny_model_dir, **kw)
    old, _ = single.compute_logprobs(rb)
    old = (old + 0.3 * torch.randn(old.shape, generator=g)).clamp(max=-1e-3) * rb.response_mask
    batch = TrainBatch.from_rollout(
        rb,
        advantages=torch.randn(16, generator=g),
        old_logprobs=old,
        ref_logprobs=single.compute_logprobs(rb, ref=True)[0],
    )

    group = ActorGroup(tiny_model_dir, 2, lr=1e-4, weight_decay=0.0, **kw)
    try:
        # Ray sets OMP_NUM_THREADS=1 (the ranks' num_cpus); each rank takes its share of the cores instead.
        assert [i["threads"] for i in group.call("info")] == [cpu_threads_per_rank(2)] * 2
        lp_group, ent_group = group.compute_logprobs(rb, with_entropy=True)
        lp_single, ent_single = single.compute_logprobs(rb, with_entropy=True)
        torch.testing.assert_close(lp_group, lp_single, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent_group, ent_single, atol=1e-5, rtol=0)

        m_group = group.update_epoch(batch, loss_options)  # 2 optimizer steps of 8 global rows
        m_single = single.update(batch, loss_options)
        rank0, rank1 = rank_weights(group)
        # The ranks all-reduce the same gradients and step the same optimizer: they agree to
        # the last bit (any difference would be a desynchronised rank).
        assert max_diff(rank0, rank1) == 0.0
        assert_same_adam_weights(rank0, full_weights(single), lr=1e-4, steps=2)  # 16 rows / 8 per step
        for key in COMPARED_METRICS:
            assert m_group[key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-6), key
        fps = group.call("state_fingerprint")
        assert fps[0] == pytest.approx(fps[1], rel=1e-9) and fps[0] == pytest.approx(
            single.state_fingerprint()
        )

        # Both ranks write one checkpoint / one HF folder (rank 0 publishes; ZeRO-3 gathers per bucket).
        group.call("save_checkpoint", str(tmp_path / "ckpt"), {"step": 7})
        group.update_epoch(batch, loss_options)  # move away from the saved state
        assert group.call("load_checkpoint", str(tmp_path / "ckpt")) == [{"step": 7}] * 2
        assert group.call("state_fingerprint") == pytest.approx(fps, rel=1e-12)
        group.call("export_hf", str(tmp_path / "hf"))
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        assert max_diff({k: v.detach() for k, v in exported.named_parameters()}, rank0) == 0.0

        # reuse_old_logprobs over ranks: each rank's first mini-batch (rows r, r + 2, ...) is the
        # batch's first 8 rows, whose old log-probs come from the update; rows 8.. from the batch.
        # The group is back at the checkpoint, which is where `single` is.
        old_now, _ = single.compute_logprobs(rb)
        later = old_now.clone()
        later[:8] = 5.0  # placeholders: read, they would change the step
        single.update(TrainBatch.from_rollout(rb, advantages=batch.advantages, old_logprobs=old_now), BANDPO)
        _, first_old, _ = group.update_on_policy(
            TrainBatch.from_rollout(rb, advantages=batch.advantages, old_logprobs=later), BANDPO
        )
        torch.testing.assert_close(first_old[:8], old_now[:8], atol=1e-5, rtol=0)
        assert not first_old[8:].any()
        assert max_diff(rank_weights(group)[0], full_weights(single)) < 1e-5
    finally:
        group.shutdown()
