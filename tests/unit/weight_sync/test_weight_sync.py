"""Flat /dev/shm weight files (the CPU transport) and CUDA IPC buckets (the colocated GPU one); no engine needed."""

from __future__ import annotations

import os

import pytest
import torch

from bandpo.flat_buffer import ALIGN, TensorMeta, copy_bytes_baseline, metas_from_wire, metas_to_wire
from bandpo.shm.weight_files import read_weights_shm, remove_shm, write_weights_shm


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(33, 7, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.zeros(0, 4)),
        ("ints", torch.arange(11, dtype=torch.int64)),
        ("strided", torch.randn(6, 4, generator=g).t()),  # non-contiguous source
        ("half", torch.randn(3, 3, generator=g).half()),
    ]


@pytest.fixture
def shm_path(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"bandpo-test-{os.getpid()}.bin")
    yield path
    remove_shm(path)


def test_roundtrip_is_exact(shm_path):
    src = _tensors()
    metas = write_weights_shm(src, shm_path)
    got = dict(read_weights_shm(shm_path, metas))
    assert [m.name for m in metas] == [n for n, _ in src]
    for name, t in src:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t), name
    assert all(m.offset % ALIGN == 0 for m in metas)
    assert metas[0] == TensorMeta("model.embed_tokens.weight", "float32", (33, 7), 0)


def test_rewrite_in_place_and_resize(shm_path):
    metas = write_weights_shm([("w", torch.ones(4))], shm_path)
    inode = os.stat(shm_path).st_ino
    write_weights_shm([("w", torch.full((4,), 2.0))], shm_path)
    assert os.stat(shm_path).st_ino == inode  # same pages reused: no fresh allocation per sync
    assert torch.equal(dict(read_weights_shm(shm_path, metas))["w"], torch.full((4,), 2.0))
    bigger = write_weights_shm([("w", torch.full((100,), 3.0))], shm_path)
    assert torch.equal(dict(read_weights_shm(shm_path, bigger))["w"], torch.full((100,), 3.0))
    smaller = write_weights_shm([("v", torch.full((2,), 4.0))], shm_path)
    assert os.path.getsize(shm_path) == ALIGN  # shrunk to one aligned 8-byte tensor
    assert torch.equal(dict(read_weights_shm(shm_path, smaller))["v"], torch.full((2,), 4.0))


def test_write_cache_forgets_deleted_files(shm_path):
    from bandpo.shm import weight_files

    write_weights_shm([("w", torch.ones(4))], shm_path)
    assert shm_path in weight_files._WRITE_MAPS
    os.unlink(shm_path)  # removed by another process, not through remove_shm
    other = shm_path + ".other"
    try:
        write_weights_shm([("w", torch.ones(4))], other)
        assert shm_path not in weight_files._WRITE_MAPS
        metas = write_weights_shm([("w", torch.full((4,), 5.0))], shm_path)  # recreated: a new file
        assert torch.equal(dict(read_weights_shm(shm_path, metas))["w"], torch.full((4,), 5.0))
    finally:
        remove_shm(other)


def test_wire_format_roundtrip_and_short_file(shm_path):
    metas = write_weights_shm(_tensors(), shm_path)
    wire = metas_to_wire(metas)
    assert all(isinstance(x, tuple) and isinstance(x[2], list) for x in wire)
    assert metas_from_wire(wire) == metas
    assert metas_from_wire([{"name": "a", "dtype": "float32", "shape": [2], "offset": 0}])[0].nbytes == 8
    too_long = metas + [TensorMeta("extra", "float32", (1 << 20,), metas[-1].offset + 4096)]
    with pytest.raises(ValueError, match="bytes"):
        list(read_weights_shm(shm_path, too_long))
    with pytest.raises(TypeError, match="dtype"):
        _ = TensorMeta("x", "notatype", (1,), 0).nbytes


def test_copy_baseline_counts_bytes():
    src = [("a", torch.zeros(10)), ("b", torch.zeros(3, dtype=torch.float64))]
    assert copy_bytes_baseline(src) == 64 + 64  # 40 and 24 bytes, each padded to a 64-byte line


def _receive(payloads: dict, queue) -> None:
    from bandpo.weight_sync.ipc import open_ipc_bucket

    queue.put({name: t.double().sum().item() for name, t in open_ipc_bucket(payloads)})


@pytest.mark.gpu
def test_ipc_buckets_roundtrip_across_processes():
    import torch.multiprocessing as mp

    from bandpo.weight_sync.ipc import pack_ipc_bucket

    src = [(f"w{i}", torch.randn(256, 256, device="cuda")) for i in range(5)]
    ctx = mp.get_context("spawn")
    got: dict[str, float] = {}
    for bucket in (src[:2], src[2:]):
        uuid, payload, buf = pack_ipc_bucket(bucket)  # buf stays alive until the reader is done
        q = ctx.Queue()
        p = ctx.Process(target=_receive, args=({uuid: payload}, q))
        p.start()
        got.update(q.get(timeout=120))
        p.join()
        del buf
    for name, t in src:  # the reader's sums of the same float32 values, in float64: exact up to ordering
        assert got[name] == pytest.approx(t.double().sum().item(), rel=1e-9)


@pytest.mark.gpu
def test_ipc_bucket_on_another_gpu_is_refused():
    from bandpo.weight_sync.ipc import open_ipc_bucket

    with pytest.raises(RuntimeError, match="colocated"):
        list(open_ipc_bucket({"GPU-not-this-one": b""}))


def test_node_plan_lowest_rank_per_node_publishes_and_engine_only_nodes_get_a_relay():
    from bandpo.shm.weight_files import node_shm_path
    from bandpo.weight_sync.node import NodeWeightSync

    sync = NodeWeightSync([], [], "/dev/shm/x-7")
    sync.actor_nodes = ["A", "A", "B", "B", "A"]  # node of each rank
    sync.engine_nodes = ["B", "C", "A", "C", "D"]  # node of each engine
    assert sync.publishers() == {0: "/dev/shm/x-7-A.bin", 2: "/dev/shm/x-7-B.bin"}
    assert sync.relay_nodes() == {"C": 1, "D": 4}  # the first engine on each node writes its file
    assert node_shm_path("/dev/shm/x-7", "C") == sync.path("C") == "/dev/shm/x-7-C.bin"
    sync.actor_nodes = sync.engine_nodes = ["A"]  # one node: one file, no relay (the fast path)
    assert sync.publishers() == {0: "/dev/shm/x-7-A.bin"} and sync.relay_nodes() == {}
