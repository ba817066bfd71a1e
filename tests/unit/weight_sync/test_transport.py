"""The transport per layout (``rollout.weight_sync``), the IPC driver's protocol, the NCCL group's
ranks, the /dev/shm space check, and the bytes a sync copies through host memory; no engine, no GPU."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from bandpo.errors import ConfigError, SharedMemoryFull
from bandpo.weight_sync.transport import DeviceWeightSync, choose_transport, make_weight_sync


@pytest.mark.parametrize(
    "choice, layout, backend, want",
    [
        ("auto", "cpu", "vllm", "shm"),
        ("auto", "colocated", "vllm", "ipc"),
        ("auto", "split", "vllm", "nccl"),
        ("auto", "colocated", "hf", "shm"),  # the HF engine loads from /dev/shm only
        ("shm", "colocated", "vllm", "shm"),
        ("shm", "split", "vllm", "shm"),
        ("ipc", "colocated", "vllm", "ipc"),
        ("nccl", "split", "vllm", "nccl"),
    ],
)
def test_transport_per_layout(choice, layout, backend, want):
    assert choose_transport(choice, layout, backend) == want


@pytest.mark.parametrize(
    "choice, layout, backend, why",
    [
        ("ipc", "cpu", "vllm", "on CPU"),
        ("nccl", "cpu", "vllm", "on CPU"),
        ("ipc", "split", "vllm", "colocated"),
        ("nccl", "colocated", "vllm", "split"),
        ("ipc", "colocated", "hf", "rollout.backend=vllm"),
        ("grpc", "colocated", "vllm", "one of auto, ipc, nccl, shm"),
    ],
)
def test_a_transport_the_layout_cannot_carry_is_a_config_error_naming_the_key(choice, layout, backend, why):
    with pytest.raises(ConfigError, match="rollout.weight_sync") as e:
        choose_transport(choice, layout, backend)
    assert why in str(e.value)


def test_the_trainer_resolves_the_transport_from_config_and_plan():
    from bandpo.config import compose
    from bandpo.parts import resolve_plan

    colocated = compose(["model=qwen2.5-7b", "trainer.nnodes=1", "trainer.gpus_per_node=8"])
    assert resolve_plan(colocated, "cuda", "m").transport == "ipc"
    assert resolve_plan(colocated, "cpu", "m").transport == "shm"  # CPU: no placement
    split = compose(
        [
            "model=qwen2.5-7b",
            "trainer.nnodes=2",
            "trainer.gpus_per_node=8",
            "actor.gpus=8",
            "actor.num_workers=8",
            "rollout.gpus=8",
            "rollout.num_workers=4",
        ]
    )
    assert resolve_plan(split, "cuda", "m").transport == "nccl"
    bad = compose(
        ["model=qwen2.5-7b", "trainer.nnodes=1", "trainer.gpus_per_node=8", "rollout.weight_sync=nccl"]
    )
    with pytest.raises(ConfigError, match="rollout.weight_sync=nccl"):
        resolve_plan(bad, "cuda", "m")


def test_make_weight_sync_per_transport():
    from bandpo.weight_sync.node import NodeWeightSync

    assert isinstance(make_weight_sync("shm", [], [], prefix="/dev/shm/x"), NodeWeightSync)
    sync = make_weight_sync("nccl", ["a0"], ["e0"], prefix="/dev/shm/x", engine_tp=2)
    assert isinstance(sync, DeviceWeightSync) and (sync.transport, sync.engine_tp) == ("nccl", 2)
    with pytest.raises(ValueError, match="ipc or nccl"):
        DeviceWeightSync("shm", [], [])


def test_the_drivers_bound_on_a_sync_leaves_nccls_first_rendezvous_a_limit_of_its_own():
    from bandpo.weight_sync.transport import RANKS_GRACE_S

    nccl, ipc = (
        DeviceWeightSync("nccl", [], [], timeout_s=300.0),
        DeviceWeightSync("ipc", [], [], timeout_s=300.0),
    )
    # first nccl sync: the rendezvous (up to 300 s) then the broadcast's waits (up to 300 s), plus the grace
    assert nccl.limit_s() == 2 * 300.0 + RANKS_GRACE_S == 660.0
    assert ipc.limit_s() == 300.0 + RANKS_GRACE_S
    nccl.last_bytes = 1  # the first sync done: the group exists
    assert nccl.limit_s() == 300.0 + RANKS_GRACE_S


def test_nccl_group_ranks_and_update_info():
    from bandpo.flat_buffer import plan_layout
    from bandpo.weight_sync.nccl import update_info, worker_init_infos

    infos = worker_init_infos("10.0.0.1", 29500, engines=3, tp=2)
    # rank 0 is the actor; engine i's TP workers follow at 1 + 2i, 2 + 2i (vLLM adds the TP rank).
    assert [i["rank_offset"] for i in infos] == [1, 3, 5]
    assert {i["world_size"] for i in infos} == {7} and all(i["packed"] for i in infos)
    metas, _ = plan_layout([("a", torch.bfloat16, (2, 3)), ("b", torch.float32, (4,))])
    assert update_info(metas) == {
        "names": ["a", "b"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
    }


class _Engine:
    """Records ``ipc_update`` calls; ``.remote`` returns the value ``ray.get`` (faked) hands back."""

    def __init__(self, name, log, fail_on=None):
        self.name, self.log = name, log

        def remote(op, payload=None):
            log.append((name, op, payload))
            return RuntimeError(f"{name} cannot {op}") if op == fail_on else None

        self.ipc_update = types.SimpleNamespace(remote=remote)


def _fake_ray(monkeypatch):
    """Ray as the IPC driver uses it, for refs that are already values (an exception: a failed call)."""

    def get(refs, timeout=None):
        for r in refs if isinstance(refs, list) else [refs]:
            if isinstance(r, Exception):
                raise r
        return refs

    monkeypatch.setitem(
        sys.modules,
        "ray",
        types.SimpleNamespace(
            get=get, wait=lambda pending, num_returns, timeout: (pending[:num_returns], pending[num_returns:])
        ),
    )


@pytest.mark.parametrize("driver", [True, False])
def test_ipc_driver_begins_loads_each_bucket_with_every_rank_s_handle_then_finishes(monkeypatch, driver):
    from bandpo.weight_sync import ipc

    log: list = []
    _fake_ray(monkeypatch)
    # Packing needs CUDA; the protocol does not: a bucket "packs" to (this rank's GPU, its names).
    monkeypatch.setattr(ipc, "pack_ipc_bucket", lambda b: ("gpu0", ",".join(n for n, _ in b), object()))
    engines = [_Engine("e0", log), _Engine("e1", log)]
    buckets = [[("a", None), ("b", None)], [("c", None)]]

    def all_gather(mine):  # the other rank (GPU 1) is fine throughout
        log.append(("exchange", mine[0]))
        return [mine, ("ok", None if mine[1] is None else ("gpu1", "other"))]

    n = ipc.send_ipc(buckets, engines, driver=driver, all_gather=all_gather)
    assert n == 2
    loads = [
        ("exchange", "ok"),
        ("e0", "load", {"gpu0": "a,b", "gpu1": "other"}),
        ("e1", "load", {"gpu0": "a,b", "gpu1": "other"}),
        ("exchange", "ok"),
        ("exchange", "ok"),
        ("e0", "load", {"gpu0": "c", "gpu1": "other"}),
        ("e1", "load", {"gpu0": "c", "gpu1": "other"}),
        ("exchange", "ok"),
    ]
    if driver:
        assert log == [
            ("e0", "begin", None),
            ("e1", "begin", None),
            *loads,
            ("e0", "finish", None),
            ("e1", "finish", None),
        ]
    else:  # other ranks only pack and exchange: rank 0 drives the engines
        assert log == [("exchange", "ok")] * 4


def _two_ranks(monkeypatch, fail_pack_at=None, engine_fails=None):
    """Two ranks' ``send_ipc`` in two threads over a real exchange (a barrier); rank 0 drives the
    engines. Returns each rank's exception (None: it finished) and the engines' log."""
    import threading

    from bandpo.weight_sync import ipc

    _fake_ray(monkeypatch)
    packed = {0: 0, 1: 0}

    def pack(bucket):
        rank = int(threading.current_thread().name)
        packed[rank] += 1
        if rank == 0 and packed[0] == fail_pack_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory packing a bucket")
        return f"gpu{rank}", "payload", object()

    monkeypatch.setattr(ipc, "pack_ipc_bucket", pack)
    # a bound for a broken test, never reached
    slots, barrier = [None, None], threading.Barrier(2, timeout=30)

    def all_gather(mine):
        rank = int(threading.current_thread().name)
        slots[rank] = mine
        barrier.wait()
        out = list(slots)
        barrier.wait()  # both have read before the next exchange writes
        return out

    log: list = []
    engines = [_Engine("e0", log, fail_on=engine_fails)]
    errors: dict = {}

    def run(rank):
        try:
            ipc.send_ipc([[("w", None)]] * 3, engines, driver=rank == 0, all_gather=all_gather)
            errors[rank] = None
        except Exception as e:
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank was left waiting in an exchange"
    return errors, log, packed


def test_a_rank_0_that_fails_packing_ends_every_rank_at_the_next_exchange(monkeypatch):
    errors, log, packed = _two_ranks(monkeypatch, fail_pack_at=2)
    assert isinstance(errors[0], torch.cuda.OutOfMemoryError)  # rank 0 raises its own error
    assert "actor rank 0 failed packing bucket 1: OutOfMemoryError: CUDA out of memory" in str(errors[1])
    assert packed == {0: 2, 1: 2}  # nobody went on to bucket 2
    assert [op for _, op, _ in log] == ["begin", "load", "finish"]  # the engines' sync still ends


def test_an_engine_that_fails_loading_ends_every_rank(monkeypatch):
    errors, log, _ = _two_ranks(monkeypatch, engine_fails="load")
    assert str(errors[0]) == "e0 cannot load"
    assert "actor rank 0 failed loading bucket 0 into the engines: RuntimeError: e0 cannot load" in str(
        errors[1]
    )
    assert [op for _, op, _ in log] == ["begin", "load", "finish"]


def test_an_engine_that_fails_to_begin_ends_every_rank_before_any_load(monkeypatch):
    errors, log, packed = _two_ranks(monkeypatch, engine_fails="begin")
    assert str(errors[0]) == "e0 cannot begin" and "actor rank 0 failed packing bucket 0" in str(errors[1])
    assert packed == {0: 0, 1: 1} and [op for _, op, _ in log] == ["begin", "finish"]


def test_shm_space_shortfall_is_one_error_naming_size_bytes_and_fix(tmp_path):
    from bandpo.shm.weight_files import check_shm_space

    path = str(tmp_path / "w.bin")
    mb = 1 << 20
    check_shm_space(path, 10 * mb, free_total=(10 * mb, 64 * mb))  # fits exactly
    with pytest.raises(SharedMemoryFull) as e:
        check_shm_space(path, 10 * mb, reserve=10 * mb, free_total=(15 * mb, 64 * mb))
    msg = str(e.value)
    for part in (
        f"holds {64 * mb} bytes",
        f"with {15 * mb} free",
        f"needs {20 * mb} more",
        "Ray's object-store copy",
        "--shm-size=1g",
        "--ipc=host",
    ):
        assert part in msg, part
    path_obj = tmp_path / "w.bin"
    path_obj.write_bytes(b"\0" * (4 * mb))  # rewritten in place: its 4 MB already count as used
    check_shm_space(path, 10 * mb, free_total=(6 * mb, 64 * mb))


def test_a_write_that_would_not_fit_fails_before_touching_the_file(tmp_path, monkeypatch):
    from bandpo.shm import weight_files

    # Docker's default 64 MB, nearly full
    monkeypatch.setattr(weight_files, "shm_free_bytes", lambda d: (1000, 64 << 20))
    path = str(tmp_path / "w.bin")
    with pytest.raises(SharedMemoryFull, match=r"\(64.0 MiB\) with 1000 free"):
        weight_files.write_weights_shm([("w", torch.zeros(1000))], path)
    assert not os.path.exists(path)


class _CpuActor:
    """The actor's weight methods on a plain module (ZeRO-2, CPU, rank 0): no DeepSpeed needed."""

    rank, zero_stage, on_cpu = 0, 2, True

    def __init__(self, module):
        self.engine = types.SimpleNamespace(module=module)


def _bind_actor_methods():
    from bandpo.actor.worker import Actor

    for name in (
        "gathered_buckets",
        "_gathered_bucket",
        "_gathered",
        "weight_specs",
        "named_weights",
        "publish_weights_shm",
    ):
        setattr(_CpuActor, name, getattr(Actor, name))


def test_publish_streams_parameters_into_the_file_with_one_host_copy(tmp_path, monkeypatch):
    from bandpo.actor.state_io import iter_tensors
    from bandpo.flat_buffer import HostCopyCounter
    from bandpo.shm import weight_files

    _bind_actor_methods()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 50))
    actor = _CpuActor(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(weight_files, "COPY_THREADS", 1)  # the counter sees this thread's copies only
    path = str(tmp_path / "w.bin")
    with HostCopyCounter() as after:
        metas = actor.publish_weights_shm({0: path})
    got = dict(weight_files.read_weights_shm(path, metas))
    for name, p in model.named_parameters():
        assert torch.equal(got[name], p.detach()), name
    # The former path: a full CPU copy of every bucket (named_weights), then the file write.
    with HostCopyCounter() as before:
        weight_files.write_weights_shm(iter_tensors(actor.named_weights()), path)
    assert (after.bytes, before.bytes) == (weight_bytes, 2 * weight_bytes)
    assert actor.publish_weights_shm({1: path}) == []  # ZeRO-2: a rank that writes nothing returns at once
