"""Every config composes and validates; bad values fail fast, naming the key."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from bandpo.algo.band import check_upper_cap
from bandpo.algo.options import LossOptions
from bandpo.config import CONFIG_DIR, compose, loss_options, reuse_old_logprobs
from bandpo.config.checks import check_micro_batch_tokens
from bandpo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml") if p.stem != "base")


def test_every_config_composes():
    models, algorithms, rollouts = _options("model"), _options("algorithm"), _options("rollout")
    assert {"tiny", "qwen2.5-3b", "qwen2.5-7b", "llama3-8b"} <= set(models)
    # Every algorithm with every model, and every rollout with every model: each file composes, and
    # each pair that can interact (a model's sizes and TP with an engine, a model with a loss) does.
    combos = [(m, a, "vllm") for m in models for a in algorithms]
    combos += [(m, "bandpo", r) for m in models for r in rollouts if r != "vllm"]
    for model, algorithm, rollout in combos:
        overrides = [f"model={model}", f"algorithm={algorithm}", f"rollout={rollout}"]
        if rollout == "hf" and compose([f"model={model}"]).rollout.tensor_parallel_size > 1:
            # transformers generate has no tensor parallelism: one engine per GPU instead
            with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=1 rollout.num_workers=8"):
                compose(overrides)
            overrides += ["rollout.tensor_parallel_size=1", "rollout.num_workers=8"]
        cfg = compose(overrides)
        assert cfg.algorithm.name == algorithm and cfg.rollout.backend == rollout
    for data in _options("data"):
        overrides = [f"data={data}"] + (["data.train.0.path=/tmp/x.jsonl"] if data == "jsonl" else [])
        compose(overrides)


def test_defaults_follow_the_paper():
    cfg = compose(["model=qwen2.5-3b"])
    assert cfg.model.path == "Qwen/Qwen2.5-3B-Instruct"
    assert cfg.algorithm.name == "bandpo" and cfg.algorithm.band.divergence == "kl"
    assert cfg.algorithm.band.delta == 0.05 and cfg.algorithm.band.upper_cap == 10.0
    assert cfg.algorithm.loss_agg == "seq-mean-token-mean" and cfg.algorithm.kl_coef == 0.001
    assert cfg.algorithm.dual_clip == 10.0
    assert cfg.rollout.n == 32 and cfg.rollout.temperature == 1.0 and cfg.rollout.max_tokens == 4096
    assert cfg.trainer.prompts_per_step == 256 and cfg.actor.mini_batch_prompts == 64
    assert cfg.actor.lr == 1e-6 and list(cfg.actor.betas) == [0.9, 0.999] and cfg.actor.weight_decay == 0.01
    assert cfg.data.template == "dapo" and cfg.data.max_prompt_len == 1024
    grpo, ch = compose(["algorithm=grpo"]).algorithm, compose(["algorithm=clip_higher"]).algorithm
    assert (grpo.eps_low, grpo.eps_high, ch.eps_low, ch.eps_high) == (0.2, 0.2, 0.2, 0.28)


@pytest.mark.parametrize(
    "override,key",
    [
        ("algorithm.band.delta=-1", "algorithm.band.delta"),
        ("algorithm.band.divergence=js", "algorithm.band.divergence"),
        ("rollout.n=1", "rollout.n"),
        ("algorithm.loss_agg=mean", "algorithm.loss_agg"),
        ("actor.zero_stage=1", "actor.zero_stage"),
        ("actor.mini_batch_prompts=5", "actor.mini_batch_prompts"),
        ("model.path=???", "model.path"),
        ("rollout.backend=sglang", "rollout.backend"),
        ("trainer.totl_steps=3", "trainer.totl_steps"),  # a misspelt key
        ("trainer.total_steps=abc", "trainer.total_steps"),
        ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite"),
        ("algorithm.tis_cap=0.5", "algorithm.tis_cap"),
        ("algorithm.filter_groups.metric=score", "algorithm.filter_groups.metric"),
        ("algorithm.filter_groups.max_gen_rounds=0", "algorithm.filter_groups.max_gen_rounds"),
        ("algorithm.filter_groups.enable=maybe", "algorithm.filter_groups.enable"),
        ("algorithm.band.adaptive=entropic", "algorithm.band.adaptive"),
        ("trainer.trace_every=-1", "trainer.trace_every"),
        ("trainer.max_error_share=1.5", "trainer.max_error_share"),
        ("trainer.verifier_memory_gib=0", "trainer.verifier_memory_gib"),
        ("trainer.inject_nonfinite=loss", "trainer.inject_nonfinite"),
        ("trainer.verifier_actors=0", "trainer.verifier_actors"),
        ("trainer.verifier_actors=each_node", "trainer.verifier_actors"),
        ("trainer.verifier_workers=0", "trainer.verifier_workers"),
        ("rollout.verify_sync=sometimes", "rollout.verify_sync"),
        ("rollout.sleep_level=3", "rollout.sleep_level"),
        ("rollout.weight_sync_timeout=0", "rollout.weight_sync_timeout"),
        ("trainer.startup_timeout=0", "trainer.startup_timeout"),
        ("actor.bf16=yes", "actor.bf16"),
        ("actor.bf16=1", "actor.bf16"),
        ("model.dtype=fp8", "model.dtype"),
        ("actor.old_logprobs=engine", "actor.old_logprobs"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose([override])


def test_new_options_default_off_and_validate_together():
    cfg = compose([])
    # Dynamic sampling: off in the algorithm group, on in the tiny recipe (configs/model/tiny.yaml).
    assert cfg.algorithm.tis_cap is None and cfg.algorithm.filter_groups.enable is True
    assert compose(["model=qwen2.5-7b"]).algorithm.filter_groups.enable is False
    assert cfg.algorithm.band.adaptive == "none" and cfg.trainer.trace_every == 0
    compose(
        [
            "algorithm.band.adaptive=entropy",
            "algorithm.band.adaptive_norm=logv",
            "algorithm.tis_cap=2",
            "algorithm.filter_groups.enable=true",
            "trainer.trace_every=5",
        ]
    )
    with pytest.raises(
        ConfigError, match=r"algorithm\.band\.delta_max must be >= algorithm\.band\.delta_min"
    ):
        compose(["algorithm.band.adaptive=entropy", "algorithm.band.delta_min=0.3"])
    with pytest.raises(ConfigError, match=r"algorithm\.band\.adaptive_norm"):
        compose(["algorithm.band.adaptive=entropy", "algorithm.band.adaptive_norm=zscore"])
    # The band block is bandpo's: refused (not ignored) with another algorithm.
    for algo in ("grpo", "clip_higher"):
        for form in ("", "+", "++"):
            with pytest.raises(ConfigError, match="apply to algorithm=bandpo only"):
                compose([f"algorithm={algo}", f"{form}algorithm.band.adaptive=entropy"])
        compose([f"algorithm={algo}", "algorithm.tis_cap=2", "algorithm.filter_groups.enable=true"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm=dppo_tv", "algorithm.dual_clip=3"],
            r"algorithm\.dual_clip does not apply to algorithm=dppo_tv",
        ),
        (
            ["algorithm=grpo", "algorithm.ratio_cap=20"],
            r"algorithm\.ratio_cap does not apply to algorithm=grpo",
        ),
        (["algorithm=cispo", "algorithm.tau_pos=1"], r"algorithm\.tau_pos does not apply to algorithm=cispo"),
        (["algorithm=sapo", "algorithm.eps_low=0.2"], r"algorithm\.eps_low does not apply to algorithm=sapo"),
        (["algorithm=sapo", "algorithm.tau_neg=0"], r"algorithm\.tau_neg must be > 0"),
        (
            ["algorithm=gspo", "algorithm.loss_agg=token-mean"],
            r"algorithm\.loss_agg must be seq-mean-token-mean",
        ),
        (["algorithm.mismatch.mode=seq"], r"algorithm\.mismatch\.mode must be one of none, token_tis"),
        (["algorithm.mismatch.cap=0.5"], r"algorithm\.mismatch\.cap must be >= 1"),
        (["algorithm.mismatch.mode=icepop", "algorithm.tis_cap=2"], r"algorithm\.tis_cap is token-level TIS"),
    ],
)
def test_rival_and_mismatch_options_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(overrides)


def test_old_logprobs_defaults_to_recompute_and_rollout_composes_on_policy():
    assert compose([]).actor.old_logprobs == "recompute"
    cfg = compose(["actor.old_logprobs=rollout", "algorithm.kl_coef=0.01"])
    assert cfg.actor.old_logprobs == "rollout"
    assert not reuse_old_logprobs(cfg)  # pi_old is the engines' for every row: nothing to reuse
    assert not reuse_old_logprobs(compose(["actor.old_logprobs=rollout", "actor.reuse_old_logprobs=false"]))


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["trainer.max_staleness=1"], ["trainer.max_staleness=1"]),
        (["algorithm.band.adaptive=entropy"], ["algorithm.band.adaptive=entropy"]),
        (
            ["algorithm.band.adaptive=entropy", "algorithm.band.adaptive_norm=logv"],
            ["algorithm.band.adaptive=entropy"],
        ),
        (["algorithm.mismatch.mode=token_tis"], ["algorithm.mismatch.mode=token_tis"]),
        (["algorithm.mismatch.mode=icepop"], ["algorithm.mismatch.mode=icepop"]),
        (["algorithm.tis_cap=2"], ["algorithm.tis_cap=2.0"]),
        (["algorithm=grpo", "algorithm.tis_cap=2"], ["algorithm.tis_cap=2.0"]),
        (["rollout.top_p=0.9"], ["rollout.top_p=0.9", "rollout.top_k"]),
        (["rollout.top_k=20"], ["rollout.top_p", "rollout.top_k=20"]),
        (
            ["actor.lora.rank=8", "actor.lora.dropout=0.05", "actor.reuse_old_logprobs=false"],
            ["actor.lora.dropout=0.05"],
        ),
        (["actor.reuse_old_logprobs=true"], ["actor.reuse_old_logprobs=true"]),
    ],
)
def test_old_logprobs_from_rollout_is_refused_off_policy_naming_both_keys(overrides, keys):
    with pytest.raises(ConfigError) as e:
        compose(["actor.old_logprobs=rollout", *overrides])
    assert "actor.old_logprobs=rollout" in str(e.value), str(e.value)
    for key in keys:
        assert key in str(e.value), (key, str(e.value))
    compose(overrides)  # each is a valid setting with the recomputed pi_old


def _message(build) -> str:
    with pytest.raises(ValueError) as e:
        build()
    return str(e.value)


@pytest.mark.parametrize(
    "overrides, build, names",
    [
        (
            ["algorithm.dual_clip=0.5"],
            partial(LossOptions, dual_clip=0.5),
            {"dual_clip": "algorithm.dual_clip"},
        ),
        (
            ["algorithm=dppo_kl", "algorithm.ratio_cap=0.0"],
            partial(LossOptions, algorithm="dppo_kl", dual_clip=None, ratio_cap=0.0),
            {"ratio_cap": "algorithm.ratio_cap"},
        ),
        (
            ["algorithm=grpo", "algorithm.ratio_cap=2.0"],
            partial(LossOptions, algorithm="grpo", ratio_cap=2.0),
            {"ratio_cap": "algorithm.ratio_cap"},
        ),
        (
            ["algorithm.band.upper_cap=0.5"],
            partial(check_upper_cap, 0.5),
            {"band upper_cap": "algorithm.band.upper_cap"},
        ),
        (
            ["actor.padding_free=false", "actor.share_prompts=false", "actor.max_tokens_per_micro_batch=8"],
            partial(check_micro_batch_tokens, 8, False),
            {
                "max_tokens_per_micro_batch": "actor.max_tokens_per_micro_batch",
                "padding_free": "actor.padding_free",
            },
        ),
    ],
)
def test_config_and_the_mechanism_refuse_with_the_same_rule(overrides, build, names):
    """A rule is written once, next to the mechanism: the config's error is the mechanism's own, naming the key."""
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    expected = _message(build)
    for name, key in names.items():
        expected = expected.replace(name, key)
    assert str(e.value) == f"config error: {expected}"


def test_mismatch_options_reach_the_loss():
    o = loss_options(
        compose(
            [
                "algorithm=dppo_kl",
                "algorithm.mismatch.mode=seq_mis",
                "algorithm.mismatch.cap=3",
                "algorithm.ratio_cap=20",
            ]
        )
    )
    assert (o.algorithm, o.mismatch, o.mismatch_cap, o.ratio_cap, o.tis_cap) == (
        "dppo_kl",
        "seq_mis",
        3.0,
        20.0,
        None,
    )
    assert loss_options(compose(["algorithm=sapo"])).tau_neg == 1.05


@pytest.mark.parametrize(
    "override",
    [
        "trainer.verifier_timout=3",
        "+trainer.verifier_timout=3",
        "++trainer.verifier_timout=3",
        "~trainer.verifier_timout",
    ],
)
def test_unknown_keys_are_refused_in_every_form_with_the_closest_key(override):
    # Hydra itself adds unknown keys on +k= / ++k=: a misspelt option would be silently ignored.
    with pytest.raises(
        ConfigError,
        match=r"trainer\.verifier_timout is not a config key .*did you mean "
        r"trainer\.verifier_timeout\?",
    ):
        compose([override])


def test_known_keys_in_every_form_and_group_choices_still_compose():
    cfg = compose(
        [
            "++trainer.seed=3",
            "model=qwen2.5-3b",
            "data=jsonl",
            "data.train.0.path=/tmp/x.jsonl",
            "trainer.total_steps=7",
        ]
    )
    assert (cfg.trainer.seed, cfg.trainer.total_steps, cfg.data.train[0].path) == (3, 7, "/tmp/x.jsonl")
    with pytest.raises(ConfigError, match="zzz is not a config key"):
        compose(["+zzz=1"])


def test_verifier_actors_accepts_per_node():
    assert compose(["trainer.verifier_actors=per_node"]).trainer.verifier_actors == "per_node"


def test_missing_model_path_names_the_key():
    with pytest.raises(ConfigError, match="model.path"):
        compose(["model.path=/nonexistent/model", "model.build=null"])


def test_train_sh_fails_fast_on_bad_override(capsys):
    """The real entry point: exit 2 with a message naming the key, before any worker starts. One case
    runs as the real process (``python -m bandpo.train``: the exit code and stderr of the command);
    the others call the same ``main`` in this process, which is all the process runs before it exits
    (each case is a ``ConfigError`` from ``compose``), without paying a fresh interpreter and torch
    import each.

    (Its time, ~3 s on an idle 2-core machine, is measured by hand: no timed assertions here.)
    """
    from bandpo.train import main

    out = subprocess.run(
        [sys.executable, "-m", "bandpo.train", "algorithm=foo"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2 and "algorithm" in out.stderr, out.stderr
    cases = [
        (["algorithm.band.delta=-1"], "algorithm.band.delta"),
        (["rollout.n=1"], "rollout.n"),
        (["model.path=/nonexistent/model", "model.build=null"], "model.path"),
    ]
    for overrides, needle in cases:
        assert main(overrides) == 2, overrides
        err = capsys.readouterr().err
        assert needle in err, (overrides, err)


@pytest.mark.parametrize(
    "override, key, why",
    [
        ("actor.lr=abc", "actor.lr", "could not be converted to Float"),
        ("rollout.n=many", "rollout.n", "could not be converted to Integer"),
        ("trainer.verifier_actors=1.5", "trainer.verifier_actors", "incompatible with type hint"),
        ("algorithm.filter_groups.enable=maybe", "algorithm.filter_groups.enable", "not a valid bool"),
    ],
)
def test_a_value_of_the_wrong_type_fails_at_load_naming_the_key(override, key, why):
    """The schema's types are checked as Hydra merges the command line (bandpo.config.schema)."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}.*{why}"):
        compose([override])


def test_the_config_is_the_schema_s_dataclasses():
    from bandpo.config.schema import ActorConfig, BandConfig, TrainConfig

    cfg = compose(["actor.lr=3e-6"])
    assert isinstance(cfg, TrainConfig) and isinstance(cfg.actor, ActorConfig)
    assert isinstance(cfg.algorithm.band, BandConfig) and cfg.actor.lr == 3e-6
    assert compose(["algorithm=grpo"]).algorithm.band is None  # the band section is bandpo's
    # interpolations are resolved at load: the eval section follows the rollout's cap
    assert compose(["model=qwen2.5-3b", "rollout.max_tokens=77"]).eval.max_tokens == 77


def test_the_docs_key_table_is_the_schema_s():
    """docs/configuration.md's key table is written from the schema (python -m bandpo.config.reference)."""
    from bandpo.config import reference

    text = reference.DOC.read_text()
    assert reference.rewrite(text) == text, "run: python -m bandpo.config.reference"
    documented = {k for k, *_ in reference.rows()}
    assert "algorithm.band.delta" in documented and "trainer.reward.correct" in documented
    assert all(doc for *_, doc in reference.rows()), "every key has a one-line doc"


def test_the_verifier_follows_the_template_unless_told():
    # A template swapped alone must not be graded for the other template's answer line: boxed
    # responses read for an "Answer:" line are all "no answer", every reward the incorrect one.
    from bandpo.data import answer_format_for

    def graded(overrides):
        d = compose(overrides).data
        return answer_format_for(d.template, d.answer_format)

    assert graded([]) == "dapo"
    assert graded(["data.template=boxed"]) == "boxed"
    assert graded(["data=dapo_math", "data.template=boxed"]) == "boxed"
    assert graded(["data.template=boxed", "data.answer_format=auto"]) == "auto"  # explicit wins
    assert graded(["model=smollm2-135m"]) == "auto"  # its recipe sets it
    assert compose(["data.template=boxed"]).eval.answer_format is None  # eval follows its own template


@pytest.mark.parametrize(
    "override",
    [
        "eval.paths.amc23=/data/amc23.jsonl",
        "+eval.paths.amc23=/data/amc23.jsonl",
        "eval.paths={amc23: /data/amc23.jsonl}",
    ],
)
def test_a_local_eval_set_by_name_in_every_form(override):
    # the form the docs and the hub's offline error give (eval.paths.<name>=<file>), Hydra's +, and the whole
    # mapping; the probe follows eval's paths
    cfg = compose([override])
    assert cfg.eval.paths == {"amc23": "/data/amc23.jsonl"} == cfg.probe.paths


def test_free_map_keys_are_the_users_but_a_misspelt_map_is_still_refused():
    assert compose(["model=tiny", "model.build_args.sft_steps=5"]).model.build_args["sft_steps"] == 5
    with pytest.raises(
        ConfigError, match=r"eval\.pahts\.amc23 is not a config key .*did you mean eval\.paths\?"
    ):
        compose(["eval.pahts.amc23=/x.jsonl"])


def test_a_key_inside_a_map_that_follows_another_is_refused_naming_both_ways():
    # probe.paths is ${eval.paths}: OmegaConf would write probe.paths.x into eval.paths (evaluated too)
    for override in ("probe.paths.x=/y.jsonl", "+probe.paths.x=/y.jsonl"):
        with pytest.raises(
            ConfigError, match=r"probe\.paths\.x: probe\.paths follows eval\.paths .*probe\.paths=\{"
        ):
            compose([override])
    cfg = compose(["probe.paths={x: /y.jsonl}"])
    assert (cfg.eval.paths, cfg.probe.paths) == ({}, {"x": "/y.jsonl"})
