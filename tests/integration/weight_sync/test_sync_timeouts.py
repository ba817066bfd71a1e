"""The GPU weight sync's waits on real Ray actors (a local instance): stand-in engines and actor ranks
whose calls never return end in an error naming the stage after a tiny limit, and a dead engine ends
a wait at once. The engines are plain Ray actors, not vLLM (the waits, not the transfer, are under
test; packing a bucket needs CUDA and is replaced by a stand-in of bandpo's own). No timed
assertions: the limits are what end the tests."""

import os
import threading

import pytest

from bandpo.errors import WeightSyncTimeout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class _StuckEngine:
    """An engine whose IPC load (and everything after it: an actor runs one call at a time) never ends."""

    def __init__(self):
        self.ops = []

    def ipc_update(self, op, payload=None):
        self.ops.append(op)
        if op == "load":
            threading.Event().wait()

    def ping(self):
        return "pong"

    def die(self):
        os._exit(1)  # the process ends mid-call, as an engine that crashes during a sync


class _StuckRank:
    def send_weights(self, transport, engines, engine_tp, timeout_s):
        threading.Event().wait()  # a rank left in a collective


def test_a_call_that_never_returns_is_an_error_naming_the_stage(ray_local):
    from bandpo.weight_sync.waits import get_within

    ray = ray_local
    engine = ray.remote(_StuckEngine).options(num_cpus=0).remote()
    assert ray.get(engine.ping.remote()) == "pong"
    with pytest.raises(
        WeightSyncTimeout, match=r"weight sync: NCCL rendezvous did not finish within 0.5 s \(hint\)"
    ):
        get_within([engine.ipc_update.remote("load")], 0.5, "NCCL rendezvous", "hint")
    ray.kill(engine)


def test_a_dead_engine_ends_the_wait_at_once_while_another_would_block(ray_local):
    from ray.exceptions import RayActorError

    from bandpo.weight_sync.waits import get_within

    ray = ray_local
    stuck, dying = (ray.remote(_StuckEngine).options(num_cpus=0).remote() for _ in range(2))
    assert ray.get(dying.ping.remote()) == "pong"
    # The engine's process exits during the call (ray.kill from outside raced the next call on a
    # loaded CI machine: the call could stay queued). The limit (120 s) is the test's own bound.
    with pytest.raises(RayActorError):
        get_within(
            [stuck.ipc_update.remote("load"), dying.die.remote()], 120, "the engines' load of a bucket"
        )
    ray.kill(stuck)


def test_an_ipc_sync_whose_engine_never_loads_names_the_load(ray_local, monkeypatch):
    from bandpo.weight_sync import ipc

    ray = ray_local
    monkeypatch.setattr(ipc, "pack_ipc_bucket", lambda bucket: ("gpu0", b"payload", object()))
    engine = ray.remote(_StuckEngine).options(num_cpus=0).remote()
    assert ray.get(engine.ping.remote()) == "pong"  # started: its begin answers, its load never does
    with pytest.raises(WeightSyncTimeout) as e:
        ipc.send_ipc([[("w", None)]], [engine], driver=True, all_gather=lambda mine: [mine], timeout_s=0.5)
    assert "the engines' load of a bucket did not finish within 0.5 s" in str(e.value)
    assert "logs/rollout.log" in str(e.value)
    # the engines are told to finish either way; this one is still stuck in the load, which the note says
    assert any("finishing the engines' IPC sync failed too" in n for n in e.value.__notes__)
    ray.kill(engine)


def test_the_driver_s_wait_for_stuck_ranks_names_the_sync(ray_local, monkeypatch):
    from bandpo.weight_sync import transport

    ray = ray_local
    monkeypatch.setattr(transport, "RANKS_GRACE_S", 0.0)
    ranks = [ray.remote(_StuckRank).options(num_cpus=0).remote() for _ in range(2)]
    sync = transport.DeviceWeightSync("ipc", ranks, [], timeout_s=0.5)
    with pytest.raises(WeightSyncTimeout, match=r"ipc sync \(the actor ranks\) did not finish within 0.5 s"):
        sync.sync()
    for r in ranks:
        ray.kill(r)


class _AdapterNode:
    """An actor rank or engine of the adapter sync, all on one node: ``publish_adapter`` never returns
    when ``stuck`` (a rank left in the factors' gather), otherwise the engines' load never does."""

    def __init__(self, stuck: bool):
        self.stuck = stuck

    def node_id(self):
        return "node-0"

    def publish_adapter(self, folder, return_files):
        if self.stuck:
            threading.Event().wait()
        return 123, None

    def load_adapter(self, folder):
        threading.Event().wait()


@pytest.mark.parametrize(
    "stuck_rank,stage",
    [
        (True, "the actor ranks' adapter write (an actor rank is stuck"),
        (False, "the engines' adapter load (an engine is stuck"),
    ],
)
def test_a_stuck_adapter_sync_names_its_stage(ray_local, stuck_rank, stage):
    from bandpo.weight_sync.lora_adapter import AdapterWeightSync

    ray = ray_local
    node = ray.remote(_AdapterNode).options(num_cpus=0)
    ranks, engines = [node.remote(stuck_rank) for _ in range(2)], [node.remote(False)]
    assert ray.get([a.node_id.remote() for a in ranks + engines]) == ["node-0"] * 3  # all started
    sync = AdapterWeightSync(ranks, engines, "bandpo-adapter-test", timeout_s=0.5)
    with pytest.raises(WeightSyncTimeout) as e:
        sync.sync()
    want = stage.replace(" (", " did not finish within 0.5 s (")
    assert want in str(e.value), str(e.value)
    assert sync.last_bytes == 0
    for a in ranks + engines:
        ray.kill(a)
