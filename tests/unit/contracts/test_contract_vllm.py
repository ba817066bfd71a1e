"""API contract with the installed vLLM: every call the GPU path makes, checked by signature, no engine built.

What is checked, from bandpo's own code (nothing listed twice):
- ``vllm.LLM(...)``: the kwargs ``llm_kwargs`` builds from ``rollout_engine_kwargs`` for each
  shipped GPU config (and the CPU one) are ``LLM`` / ``EngineArgs`` parameters, with values their
  annotations allow (``Literal`` choices: dtype, logprobs_mode, distributed_executor_backend);
- every ``self.llm.<method>(...)`` in the rollout engine binds to ``LLM.<method>``; the wake-up
  tags the rollout group sends are vLLM's memory-pool tags; each ``collective_rpc`` target is a
  method of our worker extension and its arguments bind to it; the extension's names do not
  clash with vLLM's worker (vLLM refuses that);
- ``vllm.SamplingParams(**sampling_kwargs(...))`` constructs;
- every function or class imported from vllm and called in bandpo binds (``tests.helpers.contract``);
- the extension's ``self.model_runner.<method>(...)`` calls bind to vLLM's model runner;
- ``VllmWeightSyncClient`` has vLLM's ``VLLMWeightSyncClient`` protocol methods and parameters;
- the Ray executor's variables we set exist in ``vllm.envs``.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing

import pytest

from bandpo.config import compose
from bandpo.distributed.plan import ClusterShape, make_plan
from bandpo.parts import resolve_plan, rollout_engine_kwargs
from bandpo.rollout.vllm_engine import EXTENSION, VllmEngine, llm_kwargs, sampling_kwargs
from tests.helpers.contract import bind_errors, library_calls, method_calls, resolve

GPU_CONFIGS = [
    ["model=qwen2.5-3b"],
    ["model=qwen2.5-7b"],
    ["model=llama3-8b"],
    ["model=qwen2.5-7b", "actor.gpus=4", "rollout.gpus=4", "actor.num_workers=4", "rollout.num_workers=2"],
]


@pytest.fixture(scope="module")
def vllm():
    import vllm

    return vllm


def _fits(value, tp) -> bool:
    """``value`` allowed by the annotation ``tp`` (Literal choices, unions, plain classes; generics unchecked)."""
    origin = typing.get_origin(tp)
    if tp is typing.Any or isinstance(tp, (str, typing.TypeVar)):
        return True
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(tp)
        literals = [a for a in arms if typing.get_origin(a) is typing.Literal]
        if isinstance(value, str) and literals:  # a str next to a Literal of names: the names are the choices
            return any(_fits(value, a) for a in literals)
        return any(_fits(value, a) for a in arms)
    if tp is type(None):
        return value is None
    if isinstance(value, dict) and dataclasses.is_dataclass(tp):
        tp(**value)  # EngineArgs.__post_init__ turns a dict into its config dataclass; a bad field raises
        return True
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp) if isinstance(tp, type) and origin is None else True


def _llm_kwarg_errors(vllm, kwargs: dict) -> list[str]:
    from vllm.engine.arg_utils import EngineArgs

    explicit = inspect.signature(vllm.LLM.__init__).parameters
    assert any(p.kind is p.VAR_KEYWORD for p in explicit.values())  # the rest go to EngineArgs
    fields = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    errors = []
    for k, v in kwargs.items():
        if k in explicit and explicit[k].kind is not explicit[k].VAR_KEYWORD:
            tp = explicit[k].annotation
        elif k in fields:
            tp = fields[k]
        else:
            errors.append(f"{k} is neither an LLM nor an EngineArgs parameter")
            continue
        if not _fits(v, tp):
            errors.append(f"{k}={v!r} does not fit {tp}")
    return errors


@pytest.mark.parametrize("overrides", GPU_CONFIGS, ids=lambda o: " ".join(o))
def test_contract_llm_kwargs_of_the_gpu_configs(vllm, overrides):
    cfg = compose(overrides)
    engine_kw = rollout_engine_kwargs(cfg, resolve_plan(cfg, "cuda", cfg.model.path, ClusterShape(1, 8)))
    inspect.signature(VllmEngine).bind(cfg.model.path, **engine_kw)
    # VllmEngine's: its llm.sleep(level=)
    own = {k: engine_kw.pop(k) for k in ("sleep_level",) if k in engine_kw}
    assert set(own) <= {"sleep_level"}
    kwargs = llm_kwargs(cfg.model.path, on_cpu=False, **engine_kw)
    assert _llm_kwarg_errors(vllm, kwargs) == []
    assert callable(resolve(kwargs["worker_extension_cls"]))


@pytest.mark.parametrize("overrides", [[], ["actor.bf16=true", "model.fp32_head=true"]])
def test_contract_llm_kwargs_on_cpu(vllm, overrides):
    cfg = compose(["model=tiny", *overrides])
    engine_kw = rollout_engine_kwargs(cfg, resolve_plan(cfg, "cpu", cfg.model.path))
    assert ("hf_overrides" in engine_kw) == bool(overrides)  # vLLM's float32 head: hf_overrides' head_dtype
    assert _llm_kwarg_errors(vllm, llm_kwargs(cfg.model.path, on_cpu=True, **engine_kw)) == []


def test_contract_lora_kwargs_and_ranks(vllm):
    """rollout.lora_sync=adapter's engine arguments are vLLM's, and its rank list is vLLM's own."""
    from vllm.config.lora import MaxLoRARanks

    from bandpo.weight_sync.lora_adapter import VLLM_MAX_LORA_RANKS, vllm_lora_kwargs

    assert typing.get_args(MaxLoRARanks) == VLLM_MAX_LORA_RANKS
    cfg = compose(["model=tiny", "actor.lora.rank=64", "rollout.lora_sync=adapter"])  # auto merges on CPU
    engine_kw = rollout_engine_kwargs(cfg, resolve_plan(cfg, "cpu", cfg.model.path))
    inspect.signature(VllmEngine).bind(cfg.model.path, **engine_kw)
    rank = engine_kw.pop("lora_rank")  # VllmEngine's own: it adds vllm_lora_kwargs(rank)
    kwargs = llm_kwargs(cfg.model.path, on_cpu=True, **engine_kw, **vllm_lora_kwargs(rank))
    assert _llm_kwarg_errors(vllm, kwargs) == []


def test_contract_vllm_functions_called_in_bandpo(vllm):
    calls = library_calls("vllm")
    errors, bound = bind_errors(calls)
    assert errors == []
    assert bound >= 5, calls  # LLM, SamplingParams, the reload functions, set_current_vllm_config, ...


def test_contract_llm_methods_called_by_the_engine(vllm):
    calls = method_calls("self.llm", under="bandpo/rollout")
    assert {"generate", "sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "update_weights"} <= {
        c.target for c in calls
    }
    assert bind_errors(calls, owner=vllm.LLM) == ([], len(calls))


def test_contract_collective_rpc_targets_are_extension_methods(vllm):
    ext = resolve(EXTENSION)
    rpcs = [c for c in method_calls("self.llm", under="bandpo/rollout") if c.target == "collective_rpc"]
    assert rpcs
    for c in rpcs:
        method = getattr(ext, c.constants[0])  # the target, a constant string
        n_args = len(c.constants.get("args", ()))
        inspect.signature(method).bind(object(), *[object()] * n_args)


def test_contract_extension_names_do_not_clash_with_vllms_workers(vllm):
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    ext = resolve(EXTENSION)
    names = [n for n in dir(ext) if not n.startswith("__")]
    assert names and all(n.startswith(("bandpo_", "_bandpo_")) for n in names)
    assert [n for n in names if hasattr(Worker, n) or hasattr(CPUWorker, n)] == []


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_contract_model_runner_methods_used_by_the_extension(vllm, runner):
    # vLLM 0.32 runs its V2 model runner on CUDA when Triton is there (VllmConfig.use_v2_model_runner);
    # VLLM_USE_V2_MODEL_RUNNER=0 brings back V1, which is also the base of the CPU runner every CPU
    # test runs. The extension's calls must bind on both.
    if runner == "v1":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    else:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    calls = method_calls("self.model_runner", under="bandpo/rollout")
    assert {"reload_weights", "get_model", "reset_lora_state"} <= {c.target for c in calls}
    assert bind_errors(calls, owner=GPUModelRunner) == ([], len(calls))
    # what vLLM's worker calls on its runner for the LLM methods bandpo uses (sleep / wake_up read
    # .model; add_lora, finish_weight_update and the weight-transfer engine go through these)
    for method in ("add_lora", "remove_lora", "reset_lora_state", "get_model", "reload_weights"):
        assert callable(getattr(GPUModelRunner, method)), method


def test_contract_wake_up_tags_are_vllms_memory_pool_tags(vllm):
    """The group's two-step wake (weights, then KV cache) sends tags vLLM's GPU worker allocates under."""
    from vllm.v1.worker import gpu_worker

    from bandpo.rollout.group import RolloutGroup

    class Recording(RolloutGroup):
        def __init__(self):
            self.sleeps, self.workers, self.sent = True, ["engine"], []

        def call(self, method, *args):
            self.sent.append((method, *args))

    group = Recording()
    group.wake_weights(True)
    group.wake_kv_cache()
    tags = {t for method, *args in group.sent if method == "wake_up" for t in args[0]}
    source = inspect.getsource(gpu_worker.Worker)
    assert tags == {"weights", "kv_cache"}
    assert all(f'tag="{t}"' in source for t in tags)
    inspect.signature(vllm.LLM.wake_up).bind(object(), sorted(tags))


@pytest.mark.parametrize("seed", [None, 7])
def test_contract_sampling_params(vllm, seed):
    from bandpo.types import SamplingParams

    kw = sampling_kwargs(
        SamplingParams(n=4, temperature=0.9, top_p=0.95, top_k=20, max_tokens=16, seed=seed),
        prompt_len=10,
        i=3,
        max_model_len=64,
    )
    params = vllm.SamplingParams(**kw)
    assert (params.n, params.max_tokens, params.seed) == (4, 16, None if seed is None else seed + 3 * 4)


def test_contract_nccl_weight_sync_infos_are_vllms_dataclasses(vllm):
    """The dicts bandpo.weight_sync.nccl hands vLLM's NCCL weight-transfer engine build its own info
    types (a renamed or new required field fails here), and the engines' build option is a valid
    ``WeightTransferConfig``."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from bandpo.flat_buffer import TensorMeta
    from bandpo.weight_sync.nccl import ENGINE_KWARGS, update_info, worker_init_infos

    for info in worker_init_infos("10.0.0.1", 29500, engines=2, tp=2):
        NCCLWeightTransferInitInfo(**info)
    NCCLWeightTransferUpdateInfo(**update_info([TensorMeta("w", "bfloat16", (2, 3), 0)]))
    WeightTransferConfig(**ENGINE_KWARGS["weight_transfer_config"])


def test_contract_ray_executor_variables_exist(vllm):
    import vllm.envs as envs

    from bandpo.distributed.placement import engine_launch

    cfg = compose(["model=qwen2.5-7b"])
    plan = make_plan(cfg, ClusterShape(1, 8), "cuda")
    _, env = engine_launch(plan, [None], 0)
    assert set(env) == {"VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"}
    assert set(env) | {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND"} <= set(envs.environment_variables)
