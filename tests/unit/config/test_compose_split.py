"""``compose`` reuses Hydra's composition of the group choices and applies the value overrides to a copy
with Hydra's own step for them; Hydra's whole path (``hydra.compose`` of every override) is the slow
reference it is checked against: the same config, or the same error."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from bandpo.config import compose
from bandpo.config.hydra_compose import _full_config, _hydra_config

# Each form of override, alone and after or before group choices (Hydra applies value overrides after
# merging the groups, in their order, wherever they stand on the line), and each way one fails.
CASES = [
    [],
    ["actor.lr=3e-6"],
    ["actor.lr=3e-6", "algorithm=grpo", "rollout.n=4"],
    ["model=qwen2.5-7b", "data=jsonl", "data.train.0.path=/tmp/x.jsonl", "trainer.total_steps=7"],
    ["++trainer.seed=3", "model=qwen2.5-3b"],
    ["+trainer.not_a_key=1"],
    ["+trainer.seed=3"],  # "+" on a key that exists: Hydra refuses
    ["~trainer.seed"],
    ["algorithm.band.delta=0.2", "algorithm.band.delta=0.3"],  # the last one wins
    ["actor.lr=abc"],  # the schema's type refuses it
    ["trainer.no_such_key=1"],
    ["algorithm=grpo", "algorithm.band.delta=0.1"],  # below a null section
    ["algorithm=no_such_algorithm"],
    ["model.path=${oc.env:HOME}/m", "model.build=null"],  # left unresolved by both
    ["data.train=[]"],
    ["hydra.job.name=x"],  # Hydra's own keys take the whole path
]


def _outcome(fn):
    try:
        return "ok", OmegaConf.to_container(fn(), resolve=False)
    except Exception as e:  # the same error: its type and message
        return type(e).__name__, str(e)


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o) or "defaults")
def test_split_composition_equals_hydras_whole_path(overrides):
    split = _outcome(lambda: _hydra_config("train", tuple(overrides)))
    assert split == _outcome(lambda: _full_config("train", overrides))
    # The first call composed; a second one (the group choices now cached) gives the same again.
    assert _outcome(lambda: _hydra_config("train", tuple(overrides))) == split


def test_composed_configs_are_each_callers_own():
    """A caller that changes its config changes nothing another caller gets."""
    first = compose(["actor.lr=3e-6"])
    first.actor.lr = 1.0
    first.trainer.seed += 1
    again = compose(["actor.lr=3e-6"])
    assert again.actor.lr == 3e-6 and again.trainer.seed == first.trainer.seed - 1
    with pytest.raises(Exception, match="read-only"):
        _hydra_config("train", ("actor.lr=3e-6",)).actor.lr = 1.0
