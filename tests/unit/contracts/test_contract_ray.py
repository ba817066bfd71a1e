"""API contract with the installed Ray: options, strategies, placement groups and runtime_env, no cluster started.

From bandpo's own code (nothing listed twice):
- every function or class imported from ray and called in bandpo binds (``tests.helpers.contract``),
  and a placement-group strategy spelled there is one Ray knows;
- every keyword spelled in a ``.options(...)`` call is a Ray actor or task option;
- the options ``bandpo.distributed.placement`` gives each worker (actor ranks, engines at TP 1 and
  2, split layout, verifiers) pass Ray's own ``.options()`` validation, with string env values;
- ``ray.init`` takes ``ray_init_options``; its runtime_env fields are Ray's and the setup hook resolves;
- the variable that keeps every GPU visible to vLLM's Ray workers is Ray's and vLLM's CUDA platform's.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import typing
from pathlib import Path

import pytest
import ray
from ray._common.ray_option_utils import actor_options, task_options
from ray.runtime_env import RuntimeEnv
from ray.util.placement_group import VALID_PLACEMENT_GROUP_STRATEGIES, PlacementGroup

from bandpo.config import compose
from bandpo.distributed import ray_init_options
from bandpo.distributed.check import NOSET_ENV
from bandpo.distributed.placement import actor_options as rank_options
from bandpo.distributed.placement import engine_launch, verifier_options
from bandpo.distributed.plan import ClusterShape, make_plan
from tests.helpers.contract import Call, bind_errors, calls_of_method, library_calls, resolve

PLANS = {
    "colocated-tp1": (["model=qwen2.5-3b"], ClusterShape(1, 8)),
    "colocated-tp2": (["model=qwen2.5-7b"], ClusterShape(1, 8)),
    "two-nodes": (["model=qwen2.5-7b", "actor.num_workers=16", "rollout.num_workers=8"], ClusterShape(2, 8)),
    "split": (
        [
            "model=qwen2.5-7b",
            "actor.gpus=4",
            "rollout.gpus=4",
            "actor.num_workers=4",
            "rollout.num_workers=2",
        ],
        ClusterShape(1, 8),
    ),
}


def test_contract_ray_functions_called_in_bandpo():
    calls = library_calls("ray")
    errors, bound = bind_errors(calls)
    assert errors == []
    assert bound >= 30, len(calls)
    strategies = [
        c.constants["strategy"]
        for c in calls
        if c.target.endswith("placement_group.placement_group") and "strategy" in c.constants
    ]
    assert strategies and set(strategies) <= VALID_PLACEMENT_GROUP_STRATEGIES


def test_contract_the_checker_catches_a_renamed_keyword():
    errors, _ = bind_errors([Call("here:1", "ray.wait", 1, ("num_return",), False)])
    assert len(errors) == 1 and "num_return" in errors[0]


def test_contract_options_keywords_are_rays():
    calls = calls_of_method("options")
    assert len(calls) >= 5
    valid = set(actor_options) | set(task_options)
    assert [(c.where, k) for c in calls for k in c.keywords if k not in valid] == []


def _fake_groups(plan) -> list:
    from ray._raylet import PlacementGroupID

    return [PlacementGroup(PlacementGroupID.from_random()) for _ in plan.bundles]


@ray.remote
class _Actor:  # stands in for RolloutWorker / Actor / VerifierActor: .options() validates without a cluster
    pass


@pytest.mark.parametrize("name", list(PLANS))
def test_contract_worker_options_pass_rays_validation(name):
    overrides, shape = PLANS[name]
    plan = make_plan(compose(overrides), shape, "cuda")
    pgs = _fake_groups(plan)
    opts = [rank_options(plan, pgs, r) for r in range(len(plan.of("actor")))]
    for e in sorted({w.rank for w in plan.of("rollout")}):
        o, env = engine_launch(plan, pgs, e)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()), env
        opts.append({**o, "runtime_env": {"env_vars": env}})
    opts += [verifier_options(plan, i) for i in range(len(plan.of("verifier")))]
    for o in opts:
        _Actor.options(**o)
    # string strategies: those ray.remote's signature allows
    allowed = {
        a
        for sig in typing.get_overloads(ray._private.worker.remote)
        for a in _literals(typing.get_type_hints(sig).get("scheduling_strategy"))
    }
    assert {o["scheduling_strategy"] for o in opts if isinstance(o["scheduling_strategy"], str)} <= allowed


def _literals(tp) -> set:
    if tp is None:
        return set()
    if typing.get_origin(tp) is typing.Literal:
        return set(typing.get_args(tp))
    return {x for a in typing.get_args(tp) for x in _literals(a)}


@pytest.mark.parametrize("logs, ship_code", [(None, False), ("runs/r/logs", False), (None, True)])
def test_contract_ray_init_options(logs, ship_code):
    kw = ray_init_options(logs, ship_code=ship_code)
    inspect.signature(ray.init).bind(address="local", num_cpus=8, include_dashboard=False, **kw)
    env = kw["runtime_env"]
    assert set(env) <= RuntimeEnv.known_fields
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env["env_vars"].items())
    if logs:
        assert callable(resolve(env["worker_process_setup_hook"]))
        assert Path(
            next(iter(v for k, v in env["env_vars"].items() if k == "BANDPO_WORKER_LOG"))
        ).is_absolute()


def test_contract_noset_variable_is_rays_and_vllms():
    from ray._private.accelerators.nvidia_gpu import NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR

    assert NOSET_ENV == NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR
    # vLLM's CUDA platform cannot be imported by a CPU build of vLLM: read its class attribute from the source.
    source = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "platforms" / "cuda.py"
    listed = [
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "ray_noset_device_env_vars"
    ]
    assert listed and all(NOSET_ENV in v for v in listed)
