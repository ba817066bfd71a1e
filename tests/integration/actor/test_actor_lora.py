"""The DeepSpeed actor with LoRA adapters on CPU (real DeepSpeed ZeRO-2, gloo, fp32), tiny Qwen2 model.

One rank in this process: only the adapter factors move in an update; the reference log-probs (adapters
off) are the base model's bit for bit before and after it; the sync's merged tensors are PEFT's own
merge_and_unload's; a checkpoint resumes the adapter and its optimizer state; the HF export is the
merged model and the adapter in PEFT's format, which the eval merges into the same weights.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bandpo.actor.lora import LoraSettings, merged_by_peft, sync_entries
from bandpo.lora_weights import base_model
from tests.helpers.actor import (
    BANDPO,
    COMPARED_METRICS,
    assert_same_adam_weights,
    full_weights,
    make_rollout,
    make_train_batch,
    max_diff,
    new_actor,
    rank_weights,
)

pytestmark = pytest.mark.integration
pytest.importorskip("peft")

LORA = LoraSettings(rank=4, alpha=8.0)


def _params(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.engine.module.named_parameters()}


def test_lora_update_reference_and_merged_sync(tiny_model_dir):
    rb = make_rollout(8, 11)
    base = new_actor(tiny_model_dir)
    base_lp, _ = base.compute_logprobs(rb)
    base_weights = full_weights(base)

    actor = new_actor(tiny_model_dir, lora=LORA, lr=1e-2)
    assert actor.ref is None  # no second model: the reference is the adapters switched off
    before = _params(actor)
    assert all(
        (".lora_A." in n or ".lora_B." in n) == p.requires_grad
        for n, p in actor.engine.module.named_parameters()
    )
    # ZeRO-2's own list
    in_optimizer = {id(p) for group in actor.engine.optimizer.bit16_groups for p in group}
    assert in_optimizer == {id(p) for p in actor.engine.module.parameters() if p.requires_grad}
    ref0, _ = actor.compute_logprobs(rb, ref=True)
    pol0, _ = actor.compute_logprobs(rb)
    assert torch.equal(ref0, base_lp) and torch.equal(pol0, base_lp)  # B starts at zero: x + 0 is x

    for seed in (1, 2):  # the first step moves B only (A's gradient is B^T(...) = 0); the second moves A too
        actor.update(make_train_batch(actor, 8, seed=seed), BANDPO)
    after = _params(actor)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == {n for n in before if ".lora_" in n}, sorted(changed)[:5]

    ref1, _ = actor.compute_logprobs(rb, ref=True)
    pol1, _ = actor.compute_logprobs(rb)
    assert torch.equal(ref1, base_lp)
    assert float((pol1 - base_lp).abs().max()) > 1e-3  # the adapters changed the policy

    synced = full_weights(actor)
    assert list(synced) == list(base_weights)  # the base model's names, in its order
    assert [s[0] for s in actor.weight_specs()] == list(base_weights)
    reference = merged_by_peft(actor.engine.module)
    assert synced.keys() == reference.keys()
    for name in reference:
        assert torch.equal(synced[name], reference[name]), name
    targets = [n for n in synced if not torch.equal(synced[n], base_weights[n])]
    assert targets and all(any(t in n for t in LORA.target_modules) for n in targets)
    assert all(torch.equal(p, after[n]) for n, p in _params(actor).items())  # the sync wrote nothing


def test_lora_checkpoint_resumes_exactly_and_exports_are_the_merged_model_and_the_adapter(
    tiny_model_dir, tmp_path
):
    from transformers import AutoModelForCausalLM

    from bandpo.checkpoint.hf_export import consolidate

    kw = {"mini_batch_size": 4, "micro_batch_size": 2, "warmup_steps": 3, "lr": 1e-2, "lora": LORA}
    a = new_actor(tiny_model_dir, **kw)
    b1, b2 = make_train_batch(a, 8, seed=21), make_train_batch(a, 8, seed=22)
    a.update(b1, BANDPO)
    ckpt = tmp_path / "step_1" / "actor"  # the trainer's layout, which the eval's consolidation reads
    a.save_checkpoint(str(ckpt), {"step": 1})
    a.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in exported.named_parameters())
    ids = make_rollout(1, 0).response_ids
    with torch.no_grad():
        a.engine.module.eval()
        # merged W x vs W x + s B A x: the same value summed in another order (fp32 rounding only)
        torch.testing.assert_close(
            exported(input_ids=ids).logits, a.engine.module(input_ids=ids).logits, atol=1e-5, rtol=0
        )
    # The eval's consolidation of the training checkpoint merges the adapters as the export does.
    folder = consolidate(
        tmp_path / "step_1", tiny_model_dir, tmp_path / "consolidated", lora=(LORA.rank, LORA.alpha)
    )
    from_ckpt = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert max_diff(from_ckpt.state_dict(), exported.state_dict()) == 0.0
    _check_adapter_export(a, tmp_path, tiny_model_dir, exported, ids)

    m_a = a.update(b2, BANDPO)
    uninterrupted = _params(a)
    b = new_actor(tiny_model_dir, **kw)
    assert b.load_checkpoint(str(ckpt)) == {"step": 1}
    m_b = b.update(b2, BANDPO)
    assert m_b["lr"] == pytest.approx(m_a["lr"])
    # Same process, same order of operations: Adam's moments and the adapter come back exactly.
    assert max_diff(uninterrupted, _params(b)) == 0.0


def _check_adapter_export(actor, tmp_path, base_dir, exported, ids) -> None:
    """``actor.lora.export=both`` (the default) also wrote ``hf_adapter/``: PEFT loads it onto the base model
    and computes the actor's logits; the eval merges it into the weights of the merged export ``hf/``."""
    import dataclasses

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from bandpo.eval.targets import materialize, resolve_targets

    adapter = tmp_path / "hf_adapter"
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(adapter)).eval()
    assert loaded.peft_config["default"].base_model_name_or_path == base_dir
    with torch.no_grad():
        want = actor.engine.module(input_ids=ids).logits
        # The same weights and adapter operations in fp32, but the actor attends through bandpo's packed
        # attention (bandpo.actor.attention) and the loaded model through transformers' SDPA: the same
        # sums in another order, so the bound is the merged export's above (fp32 rounding, O(1) logits).
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    # The eval's merge (PEFT's merge_and_unload in fp32) forms W + (B @ A) * s as the export's
    # merged_weight does: the weights are equal bit for bit, so every eval input is the same.
    merged = materialize(resolve_targets(str(adapter))[0], base_model=None, cache="temp", temp_root=tmp_path)
    from_adapter = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert max_diff(from_adapter.state_dict(), exported.state_dict()) == 0.0

    # One kind only: the other kind's folder of the previous export is removed, not left stale beside it.
    for export, kept, gone in (("adapter", adapter, "hf"), ("merged", "hf", adapter)):
        actor.lora = dataclasses.replace(actor.lora, export=export)
        actor.export_hf(str(tmp_path / "hf"))
        assert (tmp_path / kept).is_dir() and not (tmp_path / gone).exists(), export
    actor.lora = dataclasses.replace(actor.lora, export="both")


def test_lora_in_bf16_reference_and_merged_sync(tiny_model_dir):
    """The adapters are bf16 like the base (fp32 masters in DeepSpeed's optimizer): the reference is
    still the bf16 base model bit for bit, and the sync sends bf16 tensors under the base names within
    the bound derived in tests/unit/actor/test_lora.py of PEFT's merge."""
    rb = make_rollout(8, 11)
    base = new_actor(tiny_model_dir, bf16=True)
    base_lp, _ = base.compute_logprobs(rb)
    actor = new_actor(tiny_model_dir, bf16=True, lora=LORA, lr=1e-2)
    assert {p.dtype for p in actor.engine.module.parameters()} == {torch.bfloat16}
    for seed in (1, 2):
        actor.update(make_train_batch(actor, 8, seed=seed), BANDPO)
    ref, _ = actor.compute_logprobs(rb, ref=True)
    assert torch.equal(ref, base_lp)
    synced, merged = full_weights(actor), merged_by_peft(actor.engine.module)
    assert list(synced) == list(full_weights(base)) and {t.dtype for t in synced.values()} == {torch.bfloat16}
    eps = torch.finfo(torch.bfloat16).eps
    for e in sync_entries(actor.engine.module):
        got, want = synced[e.name].float(), merged[e.name].float()
        d = (
            0.0
            if e.lora_a is None
            else (e.lora_b.detach().float() @ e.lora_a.detach().float()).abs() * e.scaling
        )
        tol = eps * (1 + eps) * (torch.maximum(got.abs(), want.abs()) + d) if e.lora_a is not None else 0.0
        assert bool(((got - want).abs() <= tol).all()), e.name


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_adapter_is_bf16_with_fp32_masters_under_zero2_and_zero3(tiny_model_dir, tmp_path, zero_stage):
    """The factors run in the base's bf16 at either stage (PEFT would upcast them to fp32, which only
    ZeRO-2's cast undoes), before and after a step; DeepSpeed's fp32 master copy of them is what the
    optimizer steps, and the adapter file holds bf16 (2 bytes a value)."""
    actor = new_actor(tiny_model_dir, bf16=True, lora=LORA, lr=1e-2, zero_stage=zero_stage)
    module, opt = actor.engine.module, actor.engine.optimizer
    factors = [p for n, p in module.named_parameters() if ".lora_" in n]
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    masters = opt.single_partition_of_fp32_groups if zero_stage == 2 else opt.fp32_partitioned_groups_flat
    assert {t.dtype for t in masters} == {torch.float32}
    actor.update(make_train_batch(actor, 8, seed=1), BANDPO)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    nbytes, _ = actor.publish_adapter(str(tmp_path))
    file = _adapter_file(tmp_path)
    values = sum(getattr(p, "ds_numel", p.numel()) for p in factors)
    assert {t.dtype for t in file.values()} == {torch.bfloat16}
    assert sum(t.numel() for t in file.values()) == values and nbytes > 2 * values


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_with_gradient_checkpointing_takes_the_same_step(tiny_model_dir, zero_stage):
    """Recomputing activations (frozen embeddings: the checkpointed blocks' inputs need no gradient)
    gives the adapters the same update; fp32 on CPU the recomputed forward is the same arithmetic.
    Under ZeRO-3 the recomputation gathers the partitioned base layers again: the merged weights
    (gathered on read) carry the same factors."""
    after = []
    for gc in (False, True):
        actor = new_actor(
            tiny_model_dir, lora=LORA, lr=1e-2, gradient_checkpointing=gc, zero_stage=zero_stage
        )
        assert base_model(actor.engine.module).is_gradient_checkpointing == gc
        for seed in (1, 2):
            actor.update(make_train_batch(actor, 8, seed=seed), BANDPO)
        after.append(_params(actor) if zero_stage == 2 else full_weights(actor))
    assert max_diff(*after) <= 1e-6


def _adapter_file(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _adapter_config(folder) -> dict:
    import json

    config = json.loads((folder / "adapter_config.json").read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}


def test_lora_on_two_zero3_ranks_equals_one_zero2_rank(ray_local, tiny_model_dir, tmp_path):
    """Two ZeRO-3 ranks (Ray, gloo; the base built partitioned, the factors partitioned by DeepSpeed)
    against one ZeRO-2 rank in this process, on the same batch.

    Tolerances: the ranks pack other rows together than the single rank, so the same fp32 sums run in
    another order (eps 1.2e-7 times O(10) log-probs over a few layers: 1e-5, as test_actor_dp's), and
    their AdamW steps are the same trajectory up to that order (``assert_same_adam_weights``). A merged
    weight W + s B A then differs by at most s * rank * (|dB| max|A| + max|B| |dA|), each factor's
    difference within Adam's 2 lr per step. What is computed from the same numbers is compared exactly:
    the initial adapter (rank 0's, broadcast), the reference (the frozen base) before and after the
    update, a policy pass after a reference pass (ZeRO-3's prefetch trace switching order), the merged
    sync against the group's own factors, and the eval's consolidation against the export.
    """
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from bandpo.actor import ActorGroup
    from bandpo.actor.loading import weight_files
    from bandpo.checkpoint.hf_export import consolidate
    from bandpo.lora_weights import merged_weight
    from bandpo.types import TrainBatch

    lr, steps = 1e-4, 2  # 16 rows, 8 per optimizer step
    kw = {"mini_batch_size": 8, "micro_batch_size": 2, "logprob_token_budget": 40, "lora": LORA, "lr": lr}
    kw["ref_model"] = True  # ignored with LoRA: the reference is the adapters switched off
    options = replace(BANDPO, kl_coef=0.01)
    rb = make_rollout(16, seed=61)
    single = new_actor(tiny_model_dir, zero_stage=2, **kw)
    single.publish_adapter(str(tmp_path / "single0"))
    group = ActorGroup(tiny_model_dir, 2, zero_stage=3, weight_decay=0.0, **kw)
    try:
        # Before any forward every factor is a partition: the file needs the gather of every rank.
        out = group.call("publish_adapter", str(tmp_path / "group0"))
        assert (
            out[1] == (0, None)
            and out[0][0] == (tmp_path / "group0" / "adapter_model.safetensors").stat().st_size
        )
        weights = "adapter_model.safetensors"
        assert (tmp_path / "group0" / weights).read_bytes() == (tmp_path / "single0" / weights).read_bytes()
        # PEFT keeps target_modules as a set: its order in the JSON is the process's string hashing
        configs = [_adapter_config(tmp_path / f) for f in ("group0", "single0")]
        assert configs[0] == configs[1]
        # ZeRO-3's own parameter groups hold the factors, and nothing else (the lambda names no globals:
        # Ray workers unpickle it without this file).
        in_optimizer = lambda actor: sorted(  # noqa: E731
            n
            for n, p in actor.engine.module.named_parameters()
            if any(p is q for g in actor.engine.optimizer.fp16_groups for q in g)
        )
        factors = sorted(n for n in _params(single) if ".lora_" in n)
        assert group.call("__ray_call__", in_optimizer) == [factors] * 2
        assert group.call("__ray_call__", lambda actor: actor.ref is None) == [True] * 2
        # names, dtypes and full shapes (ds_shape) without a gather, as the sync plans its layout
        assert group.call("weight_specs") == [single.weight_specs()] * 2
        lp_g0, ent_g = group.compute_logprobs(rb, with_entropy=True)
        ref_g0, _ = group.compute_logprobs(rb, ref=True)
        assert torch.equal(ref_g0, lp_g0)  # B = 0: the adapters add exactly 0
        lp_s, ent_s = single.compute_logprobs(rb, with_entropy=True)
        ref_s, _ = single.compute_logprobs(rb, ref=True)
        for got, want in ((lp_g0, lp_s), (ent_g, ent_s), (ref_g0, ref_s)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

        g = torch.Generator().manual_seed(62)
        old = (lp_s + 0.3 * torch.randn(lp_s.shape, generator=g)).clamp(max=-1e-3) * rb.response_mask
        batch = TrainBatch.from_rollout(
            rb, advantages=torch.randn(16, generator=g), old_logprobs=old, ref_logprobs=ref_s
        )
        m_group, m_single = group.update_epoch(batch, options), single.update(batch, options)
        for key in COMPARED_METRICS:
            assert m_group[key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-6), key

        lp_g1, _ = group.compute_logprobs(rb)
        ref_g1, _ = group.compute_logprobs(rb, ref=True)
        assert torch.equal(ref_g1, ref_g0)  # the frozen base, its partitions untouched by the steps
        lp_g2, _ = group.compute_logprobs(rb)  # after the reference pass's other module order
        assert torch.equal(lp_g2, lp_g1)
        torch.testing.assert_close(lp_g1, single.compute_logprobs(rb)[0], atol=1e-5, rtol=0)
        assert float((lp_g1 - ref_g1).abs().max()) > 1e-4  # the adapters moved the policy

        group.call("publish_adapter", str(tmp_path / "group1"))
        single.publish_adapter(str(tmp_path / "single1"))
        factors_g, factors_s = _adapter_file(tmp_path / "group1"), _adapter_file(tmp_path / "single1")
        assert_same_adam_weights(factors_g, factors_s, lr=lr, steps=steps)
        rank0, rank1 = rank_weights(group)
        assert max_diff(rank0, rank1) == 0.0  # the ranks took the same steps
        merged_s = full_weights(single)
        base = {}  # the frozen base model's weights, from its files
        for file in weight_files(tiny_model_dir):
            base.update(load_file(str(file)))
        eps, d = torch.finfo(torch.float32).eps, 2 * lr * steps
        targets = [e for e in sync_entries(single.engine.module) if e.lora_a is not None]
        for e in sync_entries(single.engine.module):
            if e.lora_a is None:
                assert torch.equal(rank0[e.name], merged_s[e.name]), e.name  # frozen: the file's values
                continue
            prefix = "base_model.model." + e.name[: -len(".weight")]
            a, b = factors_g[f"{prefix}.lora_A.weight"], factors_g[f"{prefix}.lora_B.weight"]
            # the merged sync of the group is W + s B A of the group's own factors, bit for bit
            assert torch.equal(rank0[e.name], merged_weight(base[e.name], a, b, e.scaling)), e.name
            # Each factor entry within d = 2 lr a step of the single's (the hard bound; the factors' own
            # check above is the sharp one), plus each merge's rounding, eps |W + s B A|.
            bound = e.scaling * LORA.rank * d * (float(a.abs().max()) + float(b.abs().max()) + d)
            bound += 2 * eps * float(rank0[e.name].abs().max() + d)
            assert float((rank0[e.name] - merged_s[e.name]).abs().max()) <= bound, e.name
        assert len(targets) == 2 * len(LORA.target_modules)  # every target of the tiny model's 2 layers

        # A checkpoint of the two ranks resumes exactly; the eval consolidates it as the export writes.
        fps = group.call("state_fingerprint")
        ckpt = tmp_path / "step_1" / "actor"
        group.call("save_checkpoint", str(ckpt), {"step": 1})
        group.update_epoch(batch, options)  # move away from the saved state
        assert group.call("load_checkpoint", str(ckpt)) == [{"step": 1}] * 2
        assert group.call("state_fingerprint") == fps
        group.call("export_hf", str(tmp_path / "hf"))
        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        assert max_diff({k: v.detach() for k, v in exported.named_parameters()}, rank0) == 0.0
        assert max_diff(_adapter_file(tmp_path / "hf_adapter"), factors_g) == 0.0
        assert _adapter_config(tmp_path / "hf_adapter") == configs[1]
        folder = consolidate(
            tmp_path / "step_1", tiny_model_dir, tmp_path / "cons", lora=(LORA.rank, LORA.alpha)
        )
        from_ckpt = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        assert max_diff(from_ckpt.state_dict(), exported.state_dict()) == 0.0
    finally:
        group.shutdown()
