"""Weight sync on a simulated 3-node Ray cluster (one machine, so one /dev/shm for all nodes).

Node a and node b each hold an actor rank (ZeRO-3: the gathers are collectives) and an engine;
node c holds an engine and no actor rank (a split layout), so its file comes through the object
store. Files carry the node id, which is what lets the test tell the nodes' files apart. The LoRA
adapter sync's per-node folders are checked the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bandpo.types import SamplingParams, TrainBatch
from tests.helpers.actor import BANDPO, make_rollout

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODES = ("node_a", "node_b", "node_c")
STORE = 80 << 20  # bytes of object store per simulated node (the tiny model's weights are ~2 MB)


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    import ray
    from ray.cluster_utils import Cluster

    # The head (the driver's node) is node c: no CPU for actor ranks, so they go to a and b.
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "resources": {"node_c": 1},
            "object_store_memory": STORE,
            "include_dashboard": False,
        },
    )
    for name in ("node_a", "node_b"):
        c.add_node(num_cpus=1, resources={name: 1}, object_store_memory=STORE)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _engine(model_dir: str, node: str):
    import ray

    from bandpo.rollout.worker import RolloutWorker

    return (
        ray.remote(RolloutWorker)
        .options(num_cpus=0, resources={node: 0.1})
        .remote("hf", model_dir, dtype="float32")
    )


def _max_gap(group, out) -> float:
    """Largest |actor logprob - engine sampling logprob| over the sampled response tokens."""
    actor_lp, _ = group.compute_logprobs(out)  # [N, R]
    return (actor_lp - out.rollout_logprobs)[out.response_mask.bool()].abs().max().item()


def test_each_node_loads_its_own_file_and_logprobs_match(cluster, tiny_model_dir):
    import ray

    from bandpo.actor import ActorGroup
    from bandpo.shm.weight_files import read_file_bytes
    from bandpo.weight_sync.checksums import WeightSyncMismatch, verify_engines
    from bandpo.weight_sync.node import NodeWeightSync

    group = ActorGroup(
        tiny_model_dir, 2, zero_stage=3, lr=1e-2, weight_decay=0.0, mini_batch_size=4, micro_batch_size=2
    )
    engines = [_engine(tiny_model_dir, n) for n in NODES]
    sync = NodeWeightSync(group.workers, engines, f"/dev/shm/bandpo-test-nodes-{os.getpid()}")
    try:
        node_of = {n: ray.get(e.node_id.remote()) for n, e in zip(NODES, engines)}
        assert len(set(node_of.values())) == 3
        assert sorted(group.call("node_id")) == sorted([node_of["node_a"], node_of["node_b"]])

        # Move the actor away from the engines' start weights (a few large-lr steps).
        rb = make_rollout(4, seed=3)
        batch = TrainBatch.from_rollout(
            rb, advantages=torch.tensor([1.0, -1.0, 2.0, -2.0]), old_logprobs=group.compute_logprobs(rb)[0]
        )
        for _ in range(3):
            group.update_epoch(batch, BANDPO)

        prompts = [[5, 17, 42, 9], [7, 7, 100]]
        sp = SamplingParams(n=2, max_tokens=6, seed=1)
        assert _max_gap(group, ray.get(engines[2].generate.remote(prompts, sp))) > 1e-2  # not yet synced
        # The verification (ZeRO-3: both ranks gather, rank 0 sums) sees the engines' stale weights.
        with pytest.raises(
            WeightSyncMismatch, match=r"engine 0 tensor \S+, TP rank 0 differs from the actor's"
        ):
            verify_engines(group.workers, engines, 300.0)

        sync.sync()
        sent = len(group.call("weight_specs")[0])
        assert verify_engines(group.workers, engines, 300.0) == 3 * sent  # every tensor on each engine, exact
        # Each engine loaded the file named for its own node; every node's file holds the same bytes.
        assert sync.last_loads == [(node_of[n], sync.path(node_of[n])) for n in NODES]
        assert set(sync.publishers().values()) == {sync.path(node_of["node_a"]), sync.path(node_of["node_b"])}
        assert sync.relay_nodes() == {node_of["node_c"]: 2}
        files = [read_file_bytes(sync.path(node_of[n])) for n in NODES]
        assert files[0].size > 1 << 20 and all((f == files[0]).all() for f in files[1:])

        # Parity: each engine's sampling logprobs are the synced actor's (fp32 both sides, as in
        # test_rollout's single-node sync test: 1e-3 leaves room for different kernels' summation order).
        for e in engines:
            assert _max_gap(group, ray.get(e.generate.remote(prompts, sp))) < 1e-3

        # A second sync rewrites the same files in place (the single-node fast path, per node).
        inodes = [os.stat(sync.path(node_of[n])).st_ino for n in NODES]
        sync.sync()
        assert inodes == [os.stat(sync.path(node_of[n])).st_ino for n in NODES]
    finally:
        sync.close()
        group.shutdown()
        for e in engines:
            ray.kill(e)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"bandpo-test-nodes-{os.getpid()}")]


class _AdapterEngine:
    """A rollout worker's side of the LoRA adapter sync, without vLLM: the copy between nodes is under
    test here; vLLM's load of the folder runs in test_lora_adapter_sync.py. It writes another node's
    files as ``RolloutWorker.write_adapter_files`` does and keeps the files of the folder it loads."""

    def node_id(self):
        import ray

        return ray.get_runtime_context().get_node_id()

    def write_adapter_files(self, folder, files):
        from bandpo.shm.adapter_dirs import write_adapter_files

        return write_adapter_files(folder, files)

    def load_adapter(self, folder):
        from bandpo.shm.adapter_dirs import read_adapter_files

        self.loaded = (folder, read_adapter_files(folder))
        return self.node_id()

    def last_load(self):
        return self.loaded


def test_adapter_sync_writes_each_engine_node_its_own_copy(cluster, tiny_model_dir):
    """LoRA adapter sync (``rollout.lora_sync=adapter``): actor rank 0 writes its node's folder, an engine
    on each other node (c has no actor rank) writes that node's copy, and every engine loads its own
    node's folder; all hold rank 0's bytes, and a second sync after an update carries the new adapter."""
    import ray

    from bandpo.actor import ActorGroup
    from bandpo.shm.adapter_dirs import ADAPTER_PREFIX
    from bandpo.weight_sync.lora_adapter import AdapterWeightSync

    group = ActorGroup(
        tiny_model_dir,
        1,
        lr=1e-2,
        weight_decay=0.0,
        mini_batch_size=4,
        micro_batch_size=2,
        ref_model=False,
        lora={"rank": 4, "alpha": 8},
    )
    engines = [ray.remote(_AdapterEngine).options(num_cpus=0, resources={n: 0.1}).remote() for n in NODES]
    ip = ray.util.get_node_ip_address()
    sync = AdapterWeightSync(group.workers, engines, f"{ADAPTER_PREFIX}{os.getpid()}-{ip}", timeout_s=120)
    try:
        node_of = {n: ray.get(e.node_id.remote()) for n, e in zip(NODES, engines)}
        # a killed run's folder on node c, by a driver of this machine: the first sync removes it there
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
        stale = f"{ADAPTER_PREFIX}{int(dead.stdout)}-{ip}-{node_of['node_c']}"
        os.makedirs(stale)
        (actor_node,) = group.call("node_id")
        assert actor_node in (node_of["node_a"], node_of["node_b"])
        loads = []
        for update in (False, True):
            if update:  # the adapter's B starts at zero: an update makes the second sync's bytes differ
                rb = make_rollout(4, seed=3)
                old, _ = group.compute_logprobs(rb)
                batch = TrainBatch.from_rollout(
                    rb, advantages=torch.tensor([1.0, -1.0, 2.0, -2.0]), old_logprobs=old
                )
                group.update_epoch(batch, BANDPO)
            sync.sync()
            assert not os.path.exists(stale)
            got = ray.get([e.last_load.remote() for e in engines])
            assert [folder for folder, _ in got] == [sync.folder(node_of[n]) for n in NODES]
            assert len({folder for folder, _ in got}) == 3  # one folder per node (they share a /dev/shm here)
            assert all(files == got[0][1] for _, files in got[1:])  # every copy is rank 0's
            assert sync.last_bytes == len(got[0][1]["adapter_model.safetensors"]) > 0
            loads.append(got[0][1])
        assert loads[0]["adapter_model.safetensors"] != loads[1]["adapter_model.safetensors"]
    finally:
        sync.close()
        group.shutdown()
        for e in engines:
            ray.kill(e)
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"bandpo-adapter-{os.getpid()}-")]


def test_per_node_verifiers_grade_on_every_node_with_cpus(cluster):
    """``trainer.verifier_actors=per_node``: one verifier on each node that has CPUs (a and b, not c)."""
    import ray

    from bandpo.reward.ray_scorer import RayScorer

    scorer = RayScorer(answer_format="auto", num_workers=1, timeout=5.0, actors="per_node")
    try:
        cpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0}
        assert len(cpu_nodes) == 2
        assert {node for node, _ in ray.get([a.ready.remote() for a in scorer.actors])} == cpu_nodes
        scores = scorer.score(["Answer: 1", "Answer: 2", "no idea"], ["1", "3", "4"])
        assert [s.status for s in scores] == ["correct", "incorrect", "no_answer"]
    finally:
        scorer.close()
