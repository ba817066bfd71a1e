"""The fixed-text entropy probe (``probe.*``, ``bandpo.trainer.probe``): its reductions by hand, its texts
file (written once, read back, refused when it cannot be the run's), and the trainer's use of it with
stand-in engines and actor ranks (no Ray). On the real stack: tests/integration/test_probe_run.py."""

import json

import pytest
import torch

from bandpo.config import compose
from bandpo.errors import ConfigError
from bandpo.parts import Workers
from bandpo.trainer.probe import (
    TEXTS_FILE,
    Probe,
    probe_metrics,
    read_texts,
    texts_batch,
    write_texts,
)
from bandpo.types import Example, RolloutBatch
from tests.helpers.parts import fake_parts

# Two texts of 3 and 1 tokens and one empty row; 99 sits off the mask and must count nowhere.
ENTROPY = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])  # [3, 4]
LOGPROB = torch.tensor([[-1.0, -2.0, -3.0, 99.0], [-4.0, 99.0, 99.0, 99.0], [99.0] * 4])  # [3, 4]
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # [3, 4]


def test_reductions_by_hand():
    got = probe_metrics(ENTROPY, LOGPROB, MASK, first_n=2)
    assert got == {
        "probe/texts": 3.0,
        "probe/tokens": 4.0,
        "probe/entropy": (1 + 2 + 3 + 4) / 4,  # 2.5: the token mean
        "probe/entropy_seq": (2.0 + 4.0) / 2,  # the texts' means 2 and 4, the empty row left out
        "probe/entropy_first_n": (1 + 2 + 4) / 3,  # the first 2 tokens of each text
        "probe/logprob": -(1 + 2 + 3 + 4) / 4,
    }
    # every value is a ratio of small integers: exact in float64, so == above
    assert probe_metrics(ENTROPY, LOGPROB, torch.zeros_like(MASK), 2) == {
        "probe/texts": 3.0,
        "probe/tokens": 0.0,
    }


def _records():
    return [
        {
            "set": "s",
            "id": "a",
            "prompt_ids": [5, 6],
            "responses": [[7, 8, 9], [7]],
            "finish_reasons": ["stop"] * 2,
        },
        {"set": "s", "id": "b", "prompt_ids": [4], "responses": [[3, 2]], "finish_reasons": ["length"]},
    ]


def test_texts_batch_pads_rows_to_the_ranks_and_counts_the_real_ones():
    batch, real = texts_batch(_records(), pad_id=0, world_size=2)
    assert (real, batch.size) == (3, 4)
    assert batch.response_ids.tolist() == [[7, 8, 9], [7, 0, 0], [3, 2, 0], [7, 8, 9]]  # row 0 copied
    assert batch.prompt_ids.tolist() == [[5, 6], [5, 6], [0, 4], [5, 6]]  # left-padded
    assert texts_batch(_records(), 0, 1)[0].size == 3


def test_texts_file_round_trip_and_a_torn_one_names_the_file(tmp_path):
    path = tmp_path / TEXTS_FILE
    write_texts(path, {"seed": 0}, _records())
    assert read_texts(path) == ({"seed": 0}, _records())
    path.write_text('{"settings": {"seed"')
    with pytest.raises(ConfigError, match=str(path)):
        read_texts(path)


class _Engine:
    """Answers prompt i with sample j = [10 + i, 20 + j, 2]; counts its calls."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        rows = [(p, [10 + i, 20 + j, 2], i) for i, p in enumerate(prompts) for j in range(sampling.n)]
        return RolloutBatch.from_lists(
            [r[0] for r in rows],
            [r[1] for r in rows],
            [[0.0] * 3] * len(rows),
            [r[2] for r in rows],
            ["stop"] * len(rows),
            0,
        )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from bandpo.models.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


SETS = {"s": [Example("p1", "What is 1 + 1?", "2", "s"), Example("p2", "What is 2 + 3?", "5", "s")]}


def _probe(tmp_path, tokenizer, *overrides):
    cfg = compose(["probe.every=2", "probe.n=3", "probe.seed=9", "trainer.total_steps=5", *overrides])
    return Probe(cfg, tmp_path, "/models/base", SETS, tokenizer)


def test_texts_are_sampled_once_seeded_and_read_back(tmp_path, tokenizer):
    engine = _Engine()
    probe = _probe(tmp_path, tokenizer)
    probe.prepare(engine, fresh=True, world_size=1)
    assert len(engine.calls) == 1 and (engine.calls[0].n, engine.calls[0].seed) == (3, 9)
    settings, records = read_texts(tmp_path / TEXTS_FILE)
    assert settings["model"] == "/models/base" and settings["seed"] == 9
    assert [r["id"] for r in records] == ["p1", "p2"] and records[1]["responses"][2] == [11, 22, 2]
    assert (probe.real, probe.batch.size) == (6, 6)
    for fresh in (True, False):  # a restart, a resume: the same texts, no new sampling
        again = _probe(tmp_path, tokenizer)
        again.prepare(engine, fresh=fresh, world_size=1)
        assert len(engine.calls) == 1 and torch.equal(again.batch.response_ids, probe.batch.response_ids)


def test_a_resumed_run_never_makes_texts(tmp_path, tokenizer):
    engine = _Engine()
    with pytest.raises(ConfigError, match="probe.every=2 in a resumed run"):
        _probe(tmp_path, tokenizer).prepare(engine, fresh=False, world_size=1)
    _probe(tmp_path, tokenizer).prepare(engine, fresh=True, world_size=1)
    with pytest.raises(ConfigError, match=r"other settings \(n, seed"):
        _probe(tmp_path, tokenizer, "probe.seed=1", "probe.n=2").prepare(engine, fresh=False, world_size=1)
    assert len(engine.calls) == 1
    _probe(tmp_path, tokenizer, "probe.seed=1").prepare(engine, fresh=True, world_size=1)  # a fresh start may
    assert len(engine.calls) == 2 and read_texts(tmp_path / TEXTS_FILE)[0]["seed"] == 1


def test_due_at_zero_every_k_and_the_last_step(tmp_path, tokenizer):
    probe = _probe(tmp_path, tokenizer)  # every 2 of 5 steps
    assert [s for s in range(6) if probe.due(s)] == [0, 2, 4, 5]


class _Ranks:
    """Two actor ranks' log-prob pass: entropy 1 + row, log-prob -(1 + row) per token; records batches."""

    world_size, offloads, reuse_old = 2, False, False

    def __init__(self):
        self.batches = []

    def compute_logprobs(self, batch, with_entropy=False, ref=False):
        assert with_entropy and not ref
        self.batches.append(batch)
        row = torch.arange(batch.size, dtype=torch.float32)[:, None] + 1  # [N', 1]
        mask = batch.response_mask.float()  # [N', R]
        return -row * mask, row * mask


class _Rollout(_Engine):
    sleeps = drops_weights = False

    def sleep(self):
        raise AssertionError("CPU engines do not sleep")


def test_the_trainer_probes_the_base_policy_at_step_0_on_the_real_rows(tmp_path, tokenizer):
    from bandpo.trainer.loop import Trainer

    cfg = compose(["probe.every=1", "probe.n=1", "probe.first_n=2"])
    ranks = _Ranks()
    three = {"s": [*SETS["s"], Example("p3", "What is 3 + 4?", "7", "s")]}
    parts = fake_parts(
        cfg, tmp_path, workers=Workers(rollout=_Rollout(), actor=ranks), probe_sets=three, tokenizer=tokenizer
    )
    got = Trainer(cfg, parts).start_probe()
    # 3 texts of 3 tokens (entropy 1, 2, 3) padded to 4 rows for 2 ranks; the copy's 4 must count nowhere
    assert ranks.batches[0].size == 4
    assert {k: v for k, v in got.items() if k != "time/probe"} == {
        "probe/texts": 3.0,
        "probe/tokens": 9.0,
        "probe/entropy": 2.0,
        "probe/entropy_seq": 2.0,
        "probe/entropy_first_n": 2.0,
        "probe/logprob": -2.0,
    }
    assert got["time/probe"] >= 0 and (tmp_path / TEXTS_FILE).exists()


def test_off_by_default_and_then_nothing_runs(tmp_path):
    from bandpo.trainer.loop import Trainer

    cfg = compose([])
    assert cfg.probe.every == 0
    trainer = Trainer(cfg, fake_parts(cfg, tmp_path))
    assert trainer.probe is None and trainer.start_probe() == {}
    assert not (tmp_path / TEXTS_FILE).exists() and json.dumps(cfg.probe.datasets)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["probe.every=-1"], "probe.every"),
        (["probe.every=1", "probe.n=0"], "probe.n"),
        (["probe.every=1", "probe.limit=0"], "probe.limit"),
        (["probe.every=1", "probe.seed=-2"], "probe.seed"),
        (["probe.every=1", "probe.first_n=0"], "probe.first_n"),
        (["probe.every=1", "probe.datasets=[]"], "probe.datasets"),
    ],
)
def test_bad_probe_keys_are_refused_naming_them(overrides, key):
    with pytest.raises(ConfigError, match=key):
        compose(overrides)
    compose(["probe.every=0", *overrides[1:]])  # off: the other keys are not read


class _SleepingRollout(_Rollout):
    """Colocated GPU engines: they sleep for the actor's stages; every call goes to ``log``."""

    sleeps = True

    def __init__(self, log):
        super().__init__()
        self.log = log

    def generate(self, prompts, sampling):
        self.log.append("generate")
        return super().generate(prompts, sampling)

    def sleep(self):
        self.log.append("sleep")

    def wake_weights(self, load):
        self.log.append(f"wake_weights(load={load})")

    def wake_kv_cache(self):
        self.log.append("wake_kv_cache")


class _OffloadingRanks(_Ranks):
    offloads = True

    def __init__(self, log):
        super().__init__()
        self.log = log

    def compute_logprobs(self, batch, with_entropy=False, ref=False):
        self.log.append("probe")
        return super().compute_logprobs(batch, with_entropy, ref)

    def reload(self):
        self.log.append("reload")

    def offload(self):
        self.log.append("offload")

    def offload_weights(self):
        self.log.append("offload_weights")


def test_step_0_probe_on_colocated_gpus_takes_the_devices_and_gives_them_back(tmp_path, tokenizer):
    """The texts come from the awake engines (the base policy); then the engines sleep and the actor's
    states come back for the pass, and leave again before the engines wake, without a weight load (the
    weights did not change)."""
    from bandpo.trainer.loop import Trainer

    cfg = compose(["probe.every=1", "probe.n=1"])
    log = []
    workers = Workers(rollout=_SleepingRollout(log), actor=_OffloadingRanks(log))
    parts = fake_parts(cfg, tmp_path, workers=workers, probe_sets=SETS, tokenizer=tokenizer)
    assert "probe/entropy" in Trainer(cfg, parts).start_probe()
    assert log == [
        "generate",
        "sleep",
        "reload",
        "probe",
        "offload",
        "wake_weights(load=False)",
        "offload_weights",
        "wake_kv_cache",
    ]
