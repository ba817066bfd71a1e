"""The registry of algorithms: its entries, and the lists of names kept by hand outside Python (config
comments, docs tables, one recipe file per algorithm), which must name exactly the registry's algorithms."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bandpo.algo import ALGORITHMS, LossOptions, get_algorithm
from bandpo.algo.algorithm import SCOPED_OPTIONS, Algorithm
from bandpo.algo.registry import readers, why_refused
from bandpo.config import compose

REPO = Path(__file__).resolve().parents[3]
NAMES = set(ALGORITHMS)


def _names(text: str) -> set[str]:
    return set(re.findall(r"[a-z][a-z0-9_.-]*", text))


def _table_names(path: str, link: str) -> set[str]:
    """The backquoted names of the first cells of a markdown table that link to ``link``: ``| [`a`, `b`](link``."""
    cells = [line.split("|")[1] for line in (REPO / path).read_text().splitlines() if line.startswith("| [`")]
    return {name for cell in cells if f"]({link}" in cell for name in re.findall(r"`([a-z0-9_]+)`", cell)}


def test_entries_are_registered_by_their_names_in_a_fixed_order():
    assert all(isinstance(a, Algorithm) and ALGORITHMS[name] is a for name, a in ALGORITHMS.items())
    assert list(ALGORITHMS)[:3] == ["grpo", "clip_higher", "bandpo"]
    with pytest.raises(ValueError, match="algorithm must be one of grpo, clip_higher, bandpo, .*, got 'ppo'"):
        get_algorithm("ppo")


def test_every_entry_is_consistent():
    for name, algo in ALGORITHMS.items():
        assert algo.reads <= set(SCOPED_OPTIONS) and set(algo.defaults) <= algo.reads
        assert callable(algo.surrogate)
        # The dual clip is the clipped surrogate's: exactly the algorithms with ratio bounds read it.
        assert ("dual_clip" in algo.reads) == (algo.bounds is not None), name
        # Thresholds come in pairs, each with the paper's default.
        assert ({"eps_low", "eps_high"} <= algo.reads) == ("eps_low" in algo.reads), name
        assert all(k in algo.defaults for k in ("eps_low", "eps_high") if k in algo.reads), name
        assert set(algo.config_keys) <= algo.reads and not set(algo.why_not) & algo.reads
        LossOptions(algorithm=name, dual_clip=None)  # an entry's defaults are valid options


def test_every_scoped_option_is_read_by_some_algorithm_and_refused_with_a_reason():
    for option in SCOPED_OPTIONS:
        assert readers(option), option
        for name in NAMES - set(readers(option)):
            assert why_refused(name, option)


def test_each_algorithm_has_a_recipe_with_its_entrys_defaults():
    recipes = {p.stem for p in (REPO / "configs/algorithm").glob("*.yaml")}
    assert recipes == NAMES
    for name, algo in ALGORITHMS.items():
        cfg = compose([f"algorithm={name}"]).algorithm
        assert cfg.name == name
        for option in (
            "eps_low",
            "eps_high",
            "tau_pos",
            "tau_neg",
            "cov_ratio",
            "clip_cov_lb",
            "clip_cov_ub",
            "kl_cov_coef",
        ):
            assert getattr(cfg, option) == algo.defaults.get(option), (name, option)


def test_hand_kept_lists_name_the_registry():
    train = (REPO / "configs/train.yaml").read_text()
    assert _names(re.search(r"#\s+algorithm: ([^\n]*)", train)[1]) == NAMES
    configuration = (REPO / "docs/configuration.md").read_text()
    assert _names(re.search(r"^\| `algorithm` \| (.*?) \|", configuration, re.M)[1]) == NAMES
    assert _table_names("docs/algorithms.md", "#") == NAMES
    assert _table_names("README.md", "docs/algorithms.md#") == NAMES


def test_hand_kept_lists_name_every_model():
    models = {p.stem for p in (REPO / "configs/model").glob("*.yaml")}
    train = (REPO / "configs/train.yaml").read_text()
    assert _names(re.search(r"#\s+model: ([^(\n]*)", train)[1]) == models
    configuration = (REPO / "docs/configuration.md").read_text()
    assert _names(re.search(r"^\| `model` \| (.*?) \|", configuration, re.M)[1]) == models
