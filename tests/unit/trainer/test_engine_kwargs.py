"""The rollout engines' constructor kwargs per backend (vllm, hf) and layout (CPU, colocated, split).

Each backend gets only the options its constructor has: the HF engine once raised TypeError on
vLLM's ``distributed_executor_backend`` and never slept when colocated. The kwargs built here
are also checked against the installed vLLM in tests/unit/contracts/test_contract_vllm.py.
"""

import inspect

import pytest

from bandpo.config import compose
from bandpo.distributed.plan import ClusterShape
from bandpo.errors import ConfigError
from bandpo.parts import resolve_plan, rollout_engine_kwargs
from bandpo.rollout.hf_engine import VLLM_ONLY, HfEngine

SPLIT = [
    "actor.gpus=4",
    "rollout.gpus=4",
    "actor.num_workers=4",
    "rollout.num_workers=4",
    "rollout.tensor_parallel_size=1",
]


def _kwargs(overrides, device):
    """(the engines' kwargs, whether they sleep) on ``device``: one node of 8 GPUs for cuda."""
    cfg = compose(overrides)
    plan = resolve_plan(cfg, device, "unused", ClusterShape(1, 8))
    return rollout_engine_kwargs(cfg, plan), plan.sleeps


def test_vllm_tp2_colocated_uses_the_ray_executor_and_sleeps():
    kw, sleeps = _kwargs(["model=qwen2.5-7b"], "cuda")
    assert sleeps and kw["enable_sleep_mode"] is True
    assert (kw["tensor_parallel_size"], kw["distributed_executor_backend"]) == (2, "ray")
    assert kw["gpu_memory_utilization"] == 0.5 and kw["enforce_eager"] is False


def test_vllm_tp1_leaves_the_executor_to_vllm_and_split_does_not_sleep():
    kw, sleeps = _kwargs(["model=qwen2.5-3b"], "cuda")
    assert sleeps and kw["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in kw
    kw, sleeps = _kwargs(["model=qwen2.5-7b", *SPLIT], "cuda")
    assert not sleeps and kw["enable_sleep_mode"] is False


def test_vllm_on_cpu_runs_in_process_with_unsplit_prefills():
    kw, sleeps = _kwargs(["model=tiny"], "cpu")
    assert not sleeps
    assert (kw["distributed_executor_backend"], kw["enable_chunked_prefill"], kw["enforce_eager"]) == (
        "uni",
        False,
        True,
    )
    assert "enable_sleep_mode" not in kw and "tensor_parallel_size" not in kw


def test_max_num_seqs_reaches_vllm_only_when_set():
    kw, _ = _kwargs(["model=tiny"], "cpu")
    assert kw["max_num_seqs"] == 1024  # the tiny default: a 512-sample round in one wave
    kw, _ = _kwargs(["model=qwen2.5-7b"], "cuda")
    assert "max_num_seqs" not in kw  # null: vLLM's own default
    kw, _ = _kwargs(["model=qwen2.5-7b", "rollout.max_num_seqs=512"], "cuda")
    assert kw["max_num_seqs"] == 512
    with pytest.raises(ConfigError, match="rollout.max_num_seqs"):
        compose(["rollout.max_num_seqs=0"])


@pytest.mark.parametrize(
    "overrides, device, sleeps",
    [
        (["model=qwen2.5-3b", "rollout=hf"], "cuda", True),  # colocated: parks its weights like vLLM level 1
        (["model=qwen2.5-7b", "rollout=hf", *SPLIT], "cuda", False),
        (["model=tiny", "rollout=hf"], "cpu", False),
    ],
)
def test_hf_gets_only_its_own_options(overrides, device, sleeps):
    kw, asleep = _kwargs(overrides, device)
    assert asleep == sleeps and kw["device"] == device
    params = inspect.signature(HfEngine).parameters
    assert set(kw) <= (set(params) - {"vllm_only"}), set(kw) - set(params)
    assert not set(kw) & VLLM_ONLY


def test_hf_with_tensor_parallel_is_a_config_error_naming_the_key():
    with pytest.raises(
        ConfigError,
        match="rollout.tensor_parallel_size must be 1 with rollout.backend=hf.*rollout.num_workers=8",
    ):
        compose(["model=qwen2.5-7b", "rollout=hf"])


def test_hf_wake_up_takes_vllms_tags(tiny_model_dir):
    engine = HfEngine(tiny_model_dir, device="cpu")
    engine.sleep()
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    engine.wake_up()
    with pytest.raises(ValueError, match="unknown tags"):
        engine.wake_up(["kv"])


@pytest.mark.parametrize(
    "overrides, device, fast_cpu_bf16, dtype",
    [
        (["model=tiny"], "cpu", False, "float32"),  # this machine's kind: bf16 would be emulated
        # AVX512-BF16 / AMX: the actor computes in bf16, so do the engines
        (["model=tiny"], "cpu", True, "bfloat16"),
        (["model=tiny", "actor.bf16=false"], "cpu", True, "float32"),
        (["model=tiny", "actor.bf16=true"], "cpu", False, "bfloat16"),
        # named: used as given
        (["model=tiny", "actor.bf16=true", "model.dtype=float32"], "cpu", False, "float32"),
        (["model=tiny", "rollout=hf"], "cpu", True, "bfloat16"),
        (["model=qwen2.5-3b"], "cuda", False, "bfloat16"),
        (["model=qwen2.5-3b", "actor.bf16=false"], "cuda", False, "float32"),
    ],
)
def test_engine_dtype_follows_the_actors_precision(monkeypatch, overrides, device, fast_cpu_bf16, dtype):
    from bandpo.distributed import precision

    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: fast_cpu_bf16)
    kw, _ = _kwargs(overrides, device)
    assert kw["dtype"] == dtype


def test_old_logprobs_from_rollout_with_another_engine_dtype_stops_the_start_before_any_worker():
    from bandpo.distributed import precision
    from bandpo.parts import Workers
    from bandpo.trainer import launch

    cfg = compose(["model=tiny", "actor.old_logprobs=rollout", "actor.bf16=true", "model.dtype=float32"])
    workers = Workers()
    with pytest.raises(
        ConfigError, match=r"actor\.old_logprobs=rollout.*actor\.bf16=True.*model\.dtype=float32"
    ):
        launch.start_workers(cfg, resolve_plan(cfg, "cpu", "unused"), None, workers)
    assert workers == Workers()  # nothing started
    # engines in the actor's dtype pass the same check
    cfg = compose(["model=tiny", "actor.old_logprobs=rollout", "actor.bf16=true", "model.dtype=bfloat16"])
    precision.check_old_logprobs_dtype(
        cfg.actor.old_logprobs, cfg.actor.bf16, cfg.model.dtype, True, "bfloat16"
    )
