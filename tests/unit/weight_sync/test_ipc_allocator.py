"""The IPC bucket is allocated with PyTorch's expandable segments off: CUDA IPC of an expandable segment
goes through ``pidfd_getfd``, which Ubuntu's Yama default and unprivileged containers refuse. No GPU:
torch's allocator-settings calls, the stream and the IPC reduction are stand-ins recording the order."""

from __future__ import annotations

import types

import pytest
import torch

from bandpo.weight_sync import ipc


@pytest.fixture
def calls(monkeypatch):
    """The order of allocator-settings writes and bucket allocations in ``pack_ipc_bucket``."""
    log: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: log.append(f"set {conf}"))
    real_empty = torch.empty

    def empty(*args, **kwargs):
        log.append("alloc")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(ipc.torch, "empty", empty)
    monkeypatch.setattr(
        ipc.torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(synchronize=lambda: None)
    )
    monkeypatch.setattr(ipc, "gpu_uuid", lambda index=None: "GPU-0")
    import torch.multiprocessing.reductions as reductions

    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (None, ("args",)))
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return log


NAMED = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]


def test_the_bucket_is_allocated_with_expandable_segments_off_and_the_settings_restored(calls, monkeypatch):
    conf = "expandable_segments:True,max_split_size_mb:512"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    uuid, _, buf = ipc.pack_ipc_bucket(NAMED)
    # The whole string is rewritten: torch resets every option the string it is handed leaves out.
    assert calls == ["set expandable_segments:False,max_split_size_mb:512", "alloc", f"set {conf}"]
    assert uuid == "GPU-0" and buf.numel() >= 6 * 4 + 3 * 2


@pytest.mark.parametrize(
    "env, value",
    [
        ({}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, None),
        # PYTORCH_ALLOC_CONF, torch's accelerator-agnostic name, wins over the CUDA one
        (
            {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "x:1"},
            "expandable_segments:True",
        ),
    ],
)
def test_the_settings_are_left_alone_unless_expandable_segments_are_on(calls, monkeypatch, env, value):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ipc.pack_ipc_bucket(NAMED)
    if value is None:
        assert calls == ["alloc"]
    else:
        assert calls == ["set expandable_segments:False", "alloc", f"set {value}"]


def test_the_settings_are_restored_when_the_allocation_fails(calls, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    def oom(*args, **kwargs):
        calls.append("alloc")
        raise torch.OutOfMemoryError("no room for the bucket")

    monkeypatch.setattr(ipc.torch, "empty", oom)
    with pytest.raises(torch.OutOfMemoryError):
        ipc.pack_ipc_bucket(NAMED)
    assert calls == ["set expandable_segments:False", "alloc", "set expandable_segments:True"]


@pytest.mark.parametrize(
    "conf, want",
    [
        ("expandable_segments:True", "expandable_segments:False"),
        (
            " expandable_segments : true , garbage_collection_threshold:0.6",
            "expandable_segments:False,garbage_collection_threshold:0.6",
        ),
        ("roundup_power2_divisions:4", "roundup_power2_divisions:4,expandable_segments:False"),
    ],
)
def test_only_the_flag_is_flipped(conf, want):
    assert ipc.with_expandable_segments(conf, False) == want


@pytest.mark.gpu
def test_a_packed_bucket_maps_in_another_process_under_expandable_segments():
    """On a GPU: the probe (bandpo.tools.gpu_smoke.ipc_probe) sends a packed bucket to a spawned process
    with expandable segments on; it must map there and sum to the sender's checksum."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run(
        [sys.executable, "-m", "bandpo.tools.gpu_smoke.ipc_probe"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "packed bucket OK" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
