"""API contract with the installed DeepSpeed: the configs the GPU actor builds and every call it makes.

From bandpo's own code (nothing listed twice):
- the training config ``build_ds_config`` gives each shipped GPU model (ZeRO 2 / 3, bf16) and the
  reference model's ``build_inference_config`` are accepted by DeepSpeed's own config parser
  (``DeepSpeedConfig``: pydantic sections with unknown keys forbidden, the batch arithmetic at the
  actor's world size); DeepSpeed ignores unknown top-level keys, so each of ours must be one of
  its config constants; a ``data_types`` entry must be a dtype DeepSpeed's ``DtypeEnum`` knows;
- every function or class imported from deepspeed and called in bandpo binds (``deepspeed.initialize``
  kwargs, ``init_distributed``, ``zero.GatheredParameters``, ...);
- every ``self.engine.<attribute>`` the actor uses exists on ``DeepSpeedEngine``; the method calls bind.
"""

from __future__ import annotations

import inspect
import types

import pytest

from bandpo.actor.ds_config import build_ds_config, build_inference_config, grad_accum_steps
from bandpo.config import compose
from tests.helpers.contract import attributes_of, bind_errors, library_calls, method_calls

MODELS = ["qwen2.5-3b", "qwen2.5-7b", "llama3-8b"]


def _known_keys() -> set[str]:
    """Every string constant of DeepSpeed's config modules: the top-level keys it reads."""
    import deepspeed.runtime.constants as constants
    import deepspeed.runtime.precision_config as precision
    import deepspeed.runtime.zero.config as zero

    return {v for m in (constants, precision, zero) for v in vars(m).values() if isinstance(v, str)}


def _parse(config: dict, world_size: int, monkeypatch):
    """DeepSpeed's parser on ``config`` as rank 0 of ``world_size`` (no process group needed)."""
    import deepspeed.runtime.config as ds_config

    monkeypatch.setattr(
        ds_config, "dist", types.SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: world_size)
    )
    return ds_config.DeepSpeedConfig(config)


def _gpu_config(model: str) -> tuple[dict, int]:
    """The actor's training config for ``model`` on GPU, built as ``bandpo.actor.worker.Actor`` builds it."""
    cfg = compose([f"model={model}"])
    ac, world = cfg.actor, int(cfg.actor.num_workers)
    mini = int(ac.mini_batch_prompts) * int(cfg.rollout.n)
    given = dict(
        zero_stage=int(ac.zero_stage),
        micro_batch_size=int(ac.micro_batch_size),
        grad_accum=grad_accum_steps(mini, int(ac.micro_batch_size), world),
        world_size=world,
        grad_clip=float(ac.grad_clip),
        bf16=True,
    )
    params = inspect.signature(build_ds_config).parameters
    # options added later keep their defaults here; the parser still sees every key they produce
    return build_ds_config(**{k: v for k, v in given.items() if k in params}), world


@pytest.mark.parametrize("model", MODELS)
def test_contract_training_config_parses(model, monkeypatch):
    config, world = _gpu_config(model)
    parsed = _parse(config, world, monkeypatch)
    assert (
        parsed.zero_optimization_stage == config["zero_optimization"]["stage"]
        and parsed.bfloat16_config.enabled
    )
    assert parsed.train_batch_size == config["train_batch_size"]
    assert sorted(set(config) - _known_keys()) == []
    from deepspeed.runtime.config import DtypeEnum

    for key, dtype in config.get("data_types", {}).items():
        assert key in _known_keys()
        DtypeEnum(dtype)


@pytest.mark.parametrize("stage", [2, 3])
def test_contract_inference_config_parses(stage, monkeypatch):
    config = build_inference_config(zero_stage=stage, bf16=True)
    parsed = _parse(config, 8, monkeypatch)
    assert parsed.zero_optimization_stage == stage
    assert sorted(set(config) - _known_keys()) == []


def test_contract_deepspeed_functions_called_in_bandpo():
    calls = library_calls("deepspeed")
    assert {"deepspeed.initialize", "deepspeed.init_distributed"} <= {c.target for c in calls}
    errors, bound = bind_errors(calls)
    assert errors == [] and bound >= 4


def test_contract_engine_attributes_and_methods():
    from deepspeed.runtime.engine import DeepSpeedEngine

    # The actor ranks' engine: bandpo/actor, and its checkpoints in bandpo/checkpoint (ActorCheckpoints).
    used = attributes_of("self.engine", under="bandpo/actor") | attributes_of(
        "self.engine", under="bandpo/checkpoint"
    )
    source = inspect.getsource(DeepSpeedEngine)  # instance attributes: assigned in its methods

    def set_by_engine(a):
        return f"self.{a} =" in source or f"self.__dict__['{a}'] =" in source

    assert [a for a in sorted(used) if not hasattr(DeepSpeedEngine, a) and not set_by_engine(a)] == []
    calls = method_calls("self.engine", under="bandpo/actor") + method_calls(
        "self.engine", under="bandpo/checkpoint"
    )
    assert {"backward", "step", "save_checkpoint", "load_checkpoint"} <= {c.target for c in calls}
    assert bind_errors(calls, owner=DeepSpeedEngine) == ([], len(calls))
