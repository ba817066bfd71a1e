"""The loss options record: built once from the config, validated when built, never a loose kwargs dict."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from bandpo.algo.losses import policy_loss
from bandpo.algo.options import LossOptions
from bandpo.config import compose, loss_options
from bandpo.errors import ConfigError


def test_options_are_every_policy_loss_option_and_nothing_else():
    # policy_loss takes tensors and global normalisers as arguments and everything else from the record.
    params = set(inspect.signature(policy_loss).parameters)
    fields = {f.name for f in dataclasses.fields(LossOptions)}
    assert params == {
        "logprobs",
        "old_logprobs",
        "advantages",
        "mask",
        "options",
        "num_tokens",
        "num_seqs",
        "max_len",
        "ref_logprobs",
        "entropy",
        "old_entropy",
        "rollout_logprobs",
    }
    assert not fields & params


def test_from_config_bandpo_default():
    o = loss_options(compose([]))
    # configs/algorithm/bandpo.yaml over the schema (AlgorithmConfig) + the tiny model's rollout.max_tokens.
    cfg = compose([])
    assert (o.algorithm, o.divergence, o.delta, o.agg) == (
        "bandpo",
        cfg.algorithm.band.divergence,
        cfg.algorithm.band.delta,
        cfg.algorithm.loss_agg,
    )
    assert o.norm_len == float(cfg.rollout.max_tokens) and o.band_adaptive == "none" and o.tis_cap is None


def test_from_config_grpo_keeps_band_defaults_and_tis():
    o = loss_options(compose(["algorithm=grpo", "algorithm.tis_cap=2"]))
    assert (o.algorithm, o.eps_low, o.eps_high, o.tis_cap) == ("grpo", 0.2, 0.2, 2.0)
    assert (o.divergence, o.delta) == ("kl", 0.05)  # unused by grpo: LossOptions' defaults


def test_from_config_adaptive_band_resolves_the_radius_range():
    o = loss_options(compose(["algorithm.band.adaptive=entropy", "algorithm.band.delta=0.04"]))
    # delta_min / delta_max null -> delta / 4 and 4 delta; the scale is set per step or at start-up.
    assert (o.band_adaptive, o.delta_min, o.delta_max, o.entropy_scale) == ("entropy", 0.01, 0.16, None)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(algorithm="ppo2"), "algorithm must be one of grpo, clip_higher, bandpo, .*, got 'ppo2'"),
        (dict(agg="mean"), "agg must be one of token-mean"),
        (dict(kl_estimator="k4"), "kl_estimator must be one of k1, k2, k3"),
        (dict(dual_clip=1.0), "dual_clip must be > 1"),
        (dict(tis_cap=0.5), "tis_cap must be >= 1"),
        (dict(band_adaptive="entropic"), "band_adaptive must be one of none, entropy"),
        (
            dict(algorithm="grpo", band_adaptive="entropy"),
            "band_adaptive does not apply to algorithm=grpo .it applies to bandpo only",
        ),
    ],
)
def test_bad_options_fail_when_built(kw, message):
    with pytest.raises(ValueError, match=message):
        LossOptions(**kw)


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossOptions().delta = 0.1


def test_the_config_checks_the_loss_options_by_their_one_check_naming_the_keys(monkeypatch):
    """The loss options' rules live in ``check_loss_options`` alone: with it switched off, the config
    lets through what only it refuses (a dual clip below 1, a cap below 1, an option grpo does not read)."""
    from bandpo.algo import options

    seen = []
    monkeypatch.setattr(options, "check_loss_options", lambda values, names=None: seen.append(names))
    overrides = [
        "algorithm=grpo",
        "algorithm.dual_clip=0.5",
        "algorithm.mismatch.cap=0.5",
        "algorithm.ratio_cap=2",
    ]
    compose(overrides)
    assert seen[0]["dual_clip"] == "algorithm.dual_clip" and seen[0]["mismatch"] == "algorithm.mismatch.mode"
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"^config error: algorithm\.dual_clip must be > 1"):
        compose(overrides)
