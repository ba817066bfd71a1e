"""Colocated sleep/wake order (recording stand-in engines, no Ray): sleep after the rollout stage;
before the next rollout wake the weights, sync, then wake the KV cache (verl / OpenRLHF order)."""

import pytest

from bandpo.trainer.loop import Trainer


class _Recorder:
    """A rollout worker that records the calls it gets, into a log shared with the trainer."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def sleep(self):
        self.log.append((self.name, "sleep"))

    def wake_up(self, tags=None):
        self.log.append((self.name, "wake_up", tuple(tags)))


class _RecordingTrainer(Trainer):
    def __init__(self, engines_sleep):
        self.log, self.timings, self.engines_sleep = [], {}, engines_sleep
        self.rollout = [_Recorder(f"engine{i}", self.log) for i in range(2)]

    def _call_engines(self, method, *args):
        for w in self.rollout:
            getattr(w, method)(*args)

    def sync_weights(self):
        self.log.append(("actor", "sync"))


def test_colocated_sleep_then_wake_weights_sync_kv_cache():
    t = _RecordingTrainer(engines_sleep=True)
    t.sleep_rollout()
    t.wake_rollout(sync=True)
    assert t.log == [
        ("engine0", "sleep"), ("engine1", "sleep"),
        ("engine0", "wake_up", ("weights",)), ("engine1", "wake_up", ("weights",)),
        ("actor", "sync"),
        ("engine0", "wake_up", ("kv_cache",)), ("engine1", "wake_up", ("kv_cache",)),
    ]
    assert "sleep" in t.timings


def test_skipped_update_still_wakes_without_sync():
    t = _RecordingTrainer(engines_sleep=True)
    t.sleep_rollout()
    t.wake_rollout(sync=False)
    assert ("actor", "sync") not in t.log
    assert t.log[-1] == ("engine1", "wake_up", ("kv_cache",))


@pytest.mark.parametrize("sync", [True, False])
def test_without_sleep_mode_only_the_sync_runs(sync):
    t = _RecordingTrainer(engines_sleep=False)
    t.sleep_rollout()
    t.wake_rollout(sync=sync)
    assert t.log == ([("actor", "sync")] if sync else [])
    assert t.timings == {}


def _gpu_trainer(overrides):
    from bandpo.config import compose

    t = Trainer.__new__(Trainer)
    t.cfg, t.device = compose(overrides), "cuda"
    return t


def test_trainer_plans_from_the_configured_shape_and_spreads_verifiers():
    t = _gpu_trainer(["model=qwen2.5-7b", "trainer.nnodes=1", "trainer.gpus_per_node=8", "trainer.verifier_actors=2"])
    t.plan = t._placement_plan()
    assert (t.plan.layout, t.plan.tp, [len(b) for b in t.plan.bundles]) == ("colocated", 2, [8])
    assert t._verifier_strategies() == ["SPREAD", "SPREAD"]
    t.device = "cpu"
    assert t._placement_plan() is None  # the CPU path keeps today's placement


def test_spawn_rollout_workers_refuses_options_of_the_wrong_length():
    from bandpo.rollout.worker import spawn_rollout_workers

    with pytest.raises(ValueError, match="options_per_worker has 1 entries for 2 workers"):
        spawn_rollout_workers(2, "hf", "unused", options_per_worker=[{}])
