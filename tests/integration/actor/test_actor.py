"""The DeepSpeed actor on CPU (real DeepSpeed, gloo, fp32) with the tiny Qwen2 model.

Single-rank tests run in this process; the two-rank ones are in test_actor_dp.py, the pure
helpers' tests in tests/unit/actor/test_actor.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import psutil
import pytest
import torch

from bandpo.types import TrainBatch
from tests.helpers.actor import (
    BANDPO,
    assert_same_adam_weights,
    full_weights,
    make_rollout,
    make_train_batch,
    masked_mean_per_row,
    max_diff,
    new_actor,
    plain_hf_logprobs,
)

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------- the actor
def test_compute_logprobs_matches_plain_transformers(tiny_model_dir):
    """Left-padded prompts, right-padded responses, extra all-padding columns, several passes."""
    actor = new_actor(tiny_model_dir, logprob_token_budget=48)
    rb = make_rollout(7, 3)
    expected = plain_hf_logprobs(tiny_model_dir, rb)
    lp, ent = actor.compute_logprobs(rb, with_entropy=True)
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=0)
    assert bool((ent[rb.response_mask == 0] == 0).all()) and bool((ent[rb.response_mask == 1] > 0).all())

    wider = TrainBatch.from_rollout(rb)
    wider.prompt_ids = torch.cat([torch.zeros(7, 4, dtype=torch.long), rb.prompt_ids], 1)
    wider.prompt_mask = torch.cat([torch.zeros(7, 4, dtype=torch.long), rb.prompt_mask], 1)
    wider.response_ids = torch.cat([rb.response_ids, torch.zeros(7, 3, dtype=torch.long)], 1)
    wider.response_mask = torch.cat([rb.response_mask, torch.zeros(7, 3, dtype=torch.long)], 1)
    lp_wide, _ = actor.compute_logprobs(wider)
    torch.testing.assert_close(lp_wide[:, : lp.shape[1]], lp, atol=1e-5, rtol=0)
    assert bool((lp_wide[:, lp.shape[1] :] == 0).all())


def test_update_moves_logprobs_with_the_advantage_sign(tiny_model_dir):
    actor = new_actor(tiny_model_dir, lr=1e-3)
    rb = make_rollout(8, 5)
    mask = rb.response_mask.float()

    def step(adv_value: float) -> tuple[torch.Tensor, torch.Tensor]:
        old, _ = actor.compute_logprobs(rb)
        batch = TrainBatch.from_rollout(rb, advantages=torch.full((8,), adv_value), old_logprobs=old)
        metrics = actor.update(batch, BANDPO)
        new, _ = actor.compute_logprobs(rb)
        return masked_mean_per_row(new - old, mask), metrics

    before = full_weights(actor)
    delta, metrics = step(0.0)  # zero advantage, no KL, no weight decay: nothing moves
    assert max_diff(before, full_weights(actor)) == 0.0
    assert metrics["grad_norm"] == 0.0 and metrics["optimizer_steps"] == 1.0

    delta, metrics = step(+1.0)
    assert bool((delta > 0).all()), delta
    assert metrics["loss"] == pytest.approx(-1.0, abs=1e-6)  # ratio 1 at the start: loss = -mean A
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(1e-3)
    # the process's resident peak: torch and the model are resident (well over 50 MiB), and a peak
    # is resident memory, never more than the machine has
    assert 0.05 < metrics["peak_memory_gib"] <= psutil.virtual_memory().total / 2**30
    assert metrics["num_tokens"] == float(mask.sum())

    delta, _ = step(-1.0)
    assert bool((delta < 0).all()), delta


@pytest.mark.parametrize(
    "algorithm,agg",
    [("bandpo", "seq-mean-token-mean"), ("grpo", "token-mean"), ("clip_higher", "seq-mean-token-sum-norm")],
)
def test_micro_batch_size_does_not_change_the_update(tiny_model_dir, algorithm, agg):
    # upper_cap is the band's (and dcpo's) option: the other algorithms refuse it by name.
    loss_options = replace(
        BANDPO,
        algorithm=algorithm,
        agg=agg,
        kl_coef=0.01,
        upper_cap=BANDPO.upper_cap if algorithm == "bandpo" else None,
    )
    results = []
    for micro in (1, 4):  # 4 vs 1 micro-batches per optimizer step, 2 optimizer steps
        actor = new_actor(tiny_model_dir, mini_batch_size=4, micro_batch_size=micro, ref_model=True)
        batch = make_train_batch(actor, 8, seed=11)
        batch.ref_logprobs = actor.compute_logprobs(batch, ref=True)[0]
        metrics = actor.update(batch, loss_options)
        results.append((full_weights(actor), metrics))
    (w1, m1), (w4, m4) = results
    assert_same_adam_weights(w1, w4, lr=1e-4, steps=2)
    assert max_diff(w1, full_weights(new_actor(tiny_model_dir))) > 1e-4  # the update did something
    for key in ("loss", "pg_loss", "clip_frac_up", "clip_frac_down", "entropy", "kl_ref", "grad_norm"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-5, abs=1e-6), key
    if algorithm != "bandpo":  # band's interval is wide for these p ~ 1/400 tokens: nothing clips
        assert m1["clip_frac_up"] + m1["clip_frac_down"] > 0  # the noisy old logprobs made clipping happen


def test_checkpoint_resume_equals_uninterrupted_and_hf_export(tiny_model_dir, tmp_path):
    kw = {"mini_batch_size": 4, "micro_batch_size": 2, "warmup_steps": 3, "weight_decay": 0.01}
    a = new_actor(tiny_model_dir, **kw)
    b1, b2 = make_train_batch(a, 8, seed=21), make_train_batch(a, 8, seed=22)
    m_1 = a.update(b1, BANDPO)
    assert m_1["lr"] == pytest.approx(2e-4 / 3)  # 2nd of 3 linear warmup steps
    torch.manual_seed(1234)  # RNG state must travel with the checkpoint
    a.save_checkpoint(str(tmp_path / "ckpt"), {"step": 1, "note": "x"})
    a.save_checkpoint(str(tmp_path / "ckpt"), {"step": 1, "note": "x"})  # overwriting is atomic too
    assert not (tmp_path / "ckpt.tmp").exists() and not (tmp_path / "ckpt.old").exists()
    rand_after_save = torch.rand(3)
    m_a = a.update(b2, BANDPO)
    uninterrupted = full_weights(a)

    b = new_actor(tiny_model_dir, **kw)
    assert b.load_checkpoint(str(tmp_path / "ckpt")) == {"step": 1, "note": "x"}
    torch.testing.assert_close(torch.rand(3), rand_after_save)
    m_b = b.update(b2, BANDPO)
    assert m_b["lr"] == pytest.approx(m_a["lr"]) and m_a["lr"] == pytest.approx(1e-4)  # warmup state restored
    assert max_diff(uninterrupted, full_weights(b)) < 1e-6
    with pytest.raises(FileNotFoundError, match="not an actor checkpoint"):
        b.load_checkpoint(str(tmp_path))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    a.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).eos_token == "<|im_end|>"
    ids = make_rollout(1, 0).response_ids
    with torch.no_grad():
        a.engine.module.eval()
        torch.testing.assert_close(
            exported(input_ids=ids).logits, a.engine.module(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def test_zero3_matches_zero2_for_one_step(tiny_model_dir, tmp_path):
    """ZeRO-3 trains on CPU: same step as ZeRO-2, per-bucket gathers, partitioned ref model, export."""
    loss_options = replace(BANDPO, kl_coef=0.01)
    weights = {}
    for stage in (2, 3):
        actor = new_actor(tiny_model_dir, zero_stage=stage, ref_model=True)
        batch = make_train_batch(actor, 8, seed=31)
        batch.ref_logprobs = actor.compute_logprobs(batch, ref=True)[0]
        actor.update(batch, loss_options)
        weights[stage] = full_weights(actor)
    assert_same_adam_weights(weights[2], weights[3], lr=1e-4, steps=1)

    buckets = list(actor.named_weights(bucket_bytes=64 << 10))
    assert len(buckets) > 1
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in plain.named_parameters()]
    assert all(t.shape == plain.get_parameter(n).shape for b in buckets for n, t in b)
    # The weight file is sized from the partitioned parameters' full shapes, then filled per gathered bucket.
    from bandpo.shm.weight_files import read_weights_shm

    metas = actor.publish_weights_shm({0: str(tmp_path / "w.bin")})
    torch.testing.assert_close(
        dict(read_weights_shm(str(tmp_path / "w.bin"), metas)), weights[3], atol=0, rtol=0
    )

    actor.export_hf(str(tmp_path / "hf3"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf3"), dtype=torch.float32)
    torch.testing.assert_close(dict(exported.named_parameters()), weights[3], atol=0, rtol=0)


def test_update_rejects_bad_inputs(tiny_model_dir):
    actor = new_actor(tiny_model_dir)
    batch = make_train_batch(actor, 8, seed=41)
    with pytest.raises(TypeError, match="must be a LossOptions"):  # keyword dicts are not options
        actor.update(batch, {"algorithm": "bandpo"})
    with pytest.raises(ValueError, match="ref_logprobs"):
        actor.update(batch, replace(BANDPO, kl_coef=0.1))
    with pytest.raises(ValueError, match="not a positive multiple"):
        actor.update(batch.select(slice(0, 6)), BANDPO)
    with pytest.raises(ValueError, match="ref_model=True"):
        actor.compute_logprobs(batch, ref=True)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_nonfinite_loss_never_reaches_the_weights(tiny_model_dir, zero_stage):
    actor = new_actor(tiny_model_dir, zero_stage=zero_stage, mini_batch_size=4)
    batch = make_train_batch(actor, 8, seed=51)
    before = full_weights(actor)
    metrics = actor.update(batch, replace(BANDPO, entropy_coef=float("nan")))  # every gradient is NaN
    assert metrics["nonfinite_steps"] == metrics["optimizer_steps"] == 2.0
    assert math.isnan(metrics["grad_norm"])  # no step was applied to average over
    assert max_diff(before, full_weights(actor)) == 0.0

    metrics = actor.update(batch, BANDPO)  # the discarded steps left nothing behind
    assert metrics["nonfinite_steps"] == 0.0 and math.isfinite(metrics["grad_norm"])
    after = full_weights(actor)
    assert all(bool(torch.isfinite(t).all()) for t in after.values())
    assert max_diff(before, after) > 0


def test_update_refuses_nonfinite_inputs_naming_them(tiny_model_dir):
    actor = new_actor(tiny_model_dir)
    batch = make_train_batch(actor, 8, seed=52)
    pad_row, pad_col = (batch.response_mask == 0).nonzero()[0].tolist()
    for name, where in (("advantages", (3,)), ("old_logprobs", (pad_row, pad_col))):  # padding counts too
        bad = TrainBatch.from_rollout(
            batch, advantages=batch.advantages.clone(), old_logprobs=batch.old_logprobs.clone()
        )
        getattr(bad, name)[where] = float("nan")
        with pytest.raises(ValueError, match=f"batch.{name} holds NaN/inf"):
            actor.update(bad, BANDPO)


def test_corrupt_checkpoint_file_is_named(tiny_model_dir, tmp_path):
    actor = new_actor(tiny_model_dir)
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    [states] = (tmp_path / "ckpt").rglob("*model_states.pt")
    states.write_bytes(states.read_bytes()[:1000])  # cut short, as by a crash outside our atomic write
    with pytest.raises(RuntimeError, match=rf"corrupt checkpoint: {states} is unreadable"):
        actor.load_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_checkpoint_shard_holding_code_is_refused(tiny_model_dir, tmp_path, zero_stage):
    """A real checkpoint whose ZeRO optimizer shard also pickles a call (``os.mkdir`` of a marker):
    resuming refuses it in one line naming the file, and the marker never appears. The untouched
    checkpoint loads: DeepSpeed's own classes in its shards are allowed (``safe_load.deepspeed_globals``)."""
    import os

    from bandpo.checkpoint import safe_load
    from bandpo.errors import UnsafeCheckpoint

    class MakeDir:
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "pwned"),)

    actor = new_actor(tiny_model_dir, zero_stage=zero_stage)
    actor.save_checkpoint(str(tmp_path / "ckpt"), {"step": 1})
    assert actor.load_checkpoint(str(tmp_path / "ckpt")) == {"step": 1}
    [optim] = (tmp_path / "ckpt").rglob("*optim_states.pt")
    state = safe_load.load(optim, safe_load.deepspeed_globals())
    torch.save({**state, "extra": MakeDir()}, optim)
    with pytest.raises(UnsafeCheckpoint) as e:
        actor.load_checkpoint(str(tmp_path / "ckpt"))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(
        f"unsafe checkpoint: {optim} holds pickled code (posix.mkdir)"
    )
    assert not (tmp_path / "pwned").exists()
