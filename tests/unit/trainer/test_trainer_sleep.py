"""Colocated sleep/wake order (recording stand-in engines, no Ray): sleep after the rollout stage;
before the next rollout wake the weights, sync, then wake the KV cache (verl / OpenRLHF order)."""

import pytest

from bandpo.parts import Workers, placement_plan, resolve_plan, verifier_strategies
from bandpo.rollout.group import RolloutGroup


class _RecordingGroup(RolloutGroup):
    """A RolloutGroup whose engines record the calls they get (no Ray, no engines)."""

    def __init__(self, sleeps):
        self.sleeps, self.log = sleeps, []
        self.workers = [f"engine{i}" for i in range(2)]

    def call(self, method, *args):
        self.log.extend((w, method, *(tuple(a) for a in args)) for w in self.workers)


def _wake(group, sync: bool):
    """Stage 7's calls as ``Trainer.wake_engines`` makes them, a recorded sync between the two wakes."""
    group.wake_weights(sync)
    if sync:
        group.log.append(("actor", "sync"))
    group.wake_kv_cache()


def test_colocated_sleep_then_wake_weights_sync_kv_cache():
    g = _RecordingGroup(sleeps=True)
    g.sleep()
    _wake(g, True)
    assert g.log == [
        ("engine0", "sleep"),
        ("engine1", "sleep"),
        ("engine0", "wake_up", ("weights",)),
        ("engine1", "wake_up", ("weights",)),
        ("actor", "sync"),
        ("engine0", "wake_up", ("kv_cache",)),
        ("engine1", "wake_up", ("kv_cache",)),
    ]


def test_skipped_update_still_wakes_without_sync():
    g = _RecordingGroup(sleeps=True)
    g.sleep()
    _wake(g, False)
    assert ("actor", "sync") not in g.log
    assert g.log[-1] == ("engine1", "wake_up", ("kv_cache",))


def test_engines_that_dropped_their_weights_refuse_to_wake_without_a_load():
    g = _RecordingGroup(sleeps=True)
    g.drops_weights = True  # sleep level 2
    g.sleep()
    with pytest.raises(ValueError, match="rollout.sleep_level=2"):
        g.wake_weights(False)
    _wake(g, True)
    assert ("actor", "sync") in g.log


@pytest.mark.parametrize("level", [1, 2])
def test_the_engines_get_the_configured_level_and_the_group_knows_level_2_drops_the_weights(
    monkeypatch, level
):
    from types import SimpleNamespace

    from bandpo.config import compose
    from bandpo.distributed.plan import ClusterShape, make_plan
    from bandpo.parts import rollout_engine_kwargs
    from bandpo.rollout import group as group_module

    cfg = compose(["model=qwen2.5-3b", f"rollout.sleep_level={level}"])
    plan = resolve_plan(cfg, "cuda", "unused", ClusterShape(1, 8))
    assert plan.placement == make_plan(cfg, ClusterShape(1, 8), "cuda")
    kw, sleeps = rollout_engine_kwargs(cfg, plan), plan.sleeps
    assert sleeps and kw["sleep_level"] == level
    spawned = []  # the engines need Ray and GPUs; what the group hands them does not
    engine = SimpleNamespace(ready=SimpleNamespace(remote=lambda: None))
    monkeypatch.setattr(group_module, "spawn_rollout_workers", lambda *a, **k: spawned.append(k) or [engine])
    g = RolloutGroup(1, "vllm", "unused", sleeps=sleeps, **kw)
    assert spawned[0]["sleep_level"] == level and g.drops_weights is (level == 2)


@pytest.mark.parametrize("sync", [True, False])
def test_without_sleep_mode_only_the_sync_runs(sync):
    g = _RecordingGroup(sleeps=False)
    g.sleep()
    _wake(g, sync)
    assert g.log == ([("actor", "sync")] if sync else [])


def test_trainer_plans_from_the_configured_shape_and_spreads_verifiers():
    from bandpo.config import compose

    cfg = compose(
        ["model=qwen2.5-7b", "trainer.nnodes=1", "trainer.gpus_per_node=8", "trainer.verifier_actors=2"]
    )
    plan = placement_plan(cfg, "cuda")
    assert (plan.layout, plan.tp, [len(b) for b in plan.bundles]) == ("colocated", 2, [8])
    assert verifier_strategies(cfg, plan) == ["SPREAD", "SPREAD"]
    assert placement_plan(cfg, "cpu") is None  # the CPU path keeps today's placement


def test_spawn_rollout_workers_refuses_options_of_the_wrong_length():
    from bandpo.rollout.worker import spawn_rollout_workers

    with pytest.raises(ValueError, match="options_per_worker has 1 entries for 2 workers"):
        spawn_rollout_workers(2, "hf", "unused", options_per_worker=[{}])


@pytest.mark.parametrize(
    "overrides, transport",
    [
        ([], "ipc"),  # colocated
        (["actor.gpus=4", "actor.num_workers=4", "rollout.gpus=4", "rollout.num_workers=2"], "nccl"),  # split
        (["rollout.weight_sync=shm"], "shm"),
    ],
)
def test_the_trainer_syncs_by_the_layout_s_transport_between_the_weights_and_the_kv_cache_wake(
    monkeypatch, overrides, transport
):
    from types import SimpleNamespace

    from bandpo.config import compose
    from bandpo.trainer.loop import Trainer
    from bandpo.weight_sync import transport as transports
    from tests.helpers.parts import fake_parts

    g = _RecordingGroup(sleeps=True)
    made = []

    def fake_make(name, actors, engines, **kw):  # the real sync needs Ray and engines; the order does not
        made.append(name)
        sync = SimpleNamespace(sync=lambda: g.log.append(("actor", f"sync:{name}")))
        sync.adapter_only, sync.last_bytes = False, 0  # full weights: checksummed
        return sync

    monkeypatch.setattr(transports, "make_weight_sync", fake_make)
    cfg = compose(["model=qwen2.5-7b", "trainer.nnodes=1", "trainer.gpus_per_node=8", *overrides])
    workers = Workers(actor=SimpleNamespace(workers=["rank0"], offloads=False), rollout=g)
    # no run folder, no Ray: only what sync_weights reads
    trainer = Trainer(cfg, fake_parts(cfg, workers=workers, plan=resolve_plan(cfg, "cuda", "unused")))
    trainer.verify_sync = lambda: g.log.append(("actor", "verify"))  # the real check needs the engines
    g.sleep()
    trainer.wake_engines(load=True)
    trainer.wake_engines(load=True)  # the sync object is made once per run
    assert made == [transport]
    assert g.log[:8] == [
        ("engine0", "sleep"),
        ("engine1", "sleep"),
        ("engine0", "wake_up", ("weights",)),
        ("engine1", "wake_up", ("weights",)),
        # the run's first sync is verified
        ("actor", f"sync:{transport}"),
        ("actor", "verify"),
        ("engine0", "wake_up", ("kv_cache",)),
        ("engine1", "wake_up", ("kv_cache",)),
    ]
    assert g.log.count(("actor", "verify")) == 1  # rollout.verify_sync=false: the later syncs are not
    assert "verify_sync" in trainer.timings
