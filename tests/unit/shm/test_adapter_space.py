"""The LoRA adapter folder in /dev/shm gets the space check the weight file gets: too little room (Docker's
default 64 MB against a ~240 MB rank-64 Qwen2.5-3B adapter) is one error naming the folder, the bytes
needed, the free space and the fix, before anything is written. The file system's figures are faked."""

from __future__ import annotations

import os

import pytest
import torch

from bandpo.checkpoint.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from bandpo.errors import SharedMemoryFull
from bandpo.shm import weight_files
from bandpo.shm.adapter_dirs import write_adapter_files

MB = 1 << 20


@pytest.fixture
def docker_shm(monkeypatch):
    """Docker's default /dev/shm: 64 MiB, of which ``free[0]`` bytes are free."""
    free = [64 * MB]
    monkeypatch.setattr(weight_files, "shm_free_bytes", lambda directory: (free[0], 64 * MB))
    return free


def test_an_adapter_copy_that_does_not_fit_fails_before_writing(tmp_path, docker_shm):
    folder = tmp_path / "bandpo-adapter-1-10.0.0.1-node"
    files = {ADAPTER_WEIGHTS: b"\0" * (80 * MB), ADAPTER_CONFIG: b"{}"}
    with pytest.raises(SharedMemoryFull) as e:
        write_adapter_files(str(folder), files)
    msg = str(e.value)
    for part in (
        f"the LoRA adapter folder {folder}",
        f"holds {64 * MB} bytes (64.0 MiB) with {64 * MB} free",
        f"needs {80 * MB + 2} more",
        "docker run --shm-size=1g",
        "rollout.lora_sync=merged",
    ):
        assert part in msg, part
    assert not folder.exists()


def test_the_folders_own_files_are_rewritten_in_place_and_count_as_used(tmp_path, docker_shm):
    folder = tmp_path / "adapter"
    files = {ADAPTER_WEIGHTS: b"\1" * (3 * MB), ADAPTER_CONFIG: b"{}"}
    docker_shm[0] = 3 * MB + 2  # fits exactly
    assert write_adapter_files(str(folder), files) == 3 * MB + 2
    docker_shm[0] = 0  # the next sync's files replace these: nothing more is needed
    assert write_adapter_files(str(folder), files) == 3 * MB + 2


def test_the_actors_write_is_checked_before_peft_saves(tiny_model_dir, tmp_path, docker_shm):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from bandpo.actor.lora import LoraSettings, apply_lora
    from bandpo.actor.lora_files import adapter_file_bytes, write_adapter

    model = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraSettings(rank=4, alpha=8.0),
    )
    factors = [p for n, p in model.named_parameters() if ".lora_" in n]
    values = sum(p.numel() * p.element_size() for p in factors)
    need = adapter_file_bytes(model)
    assert values < need <= values + 512 * len(factors) + 8192  # the factors, a header bound, the config
    docker_shm[0] = need - 1
    with pytest.raises(SharedMemoryFull, match="the LoRA adapter folder"):
        write_adapter(str(tmp_path / "a"), model, tiny_model_dir)
    assert not (tmp_path / "a").exists()
    docker_shm[0] = need
    written = write_adapter(str(tmp_path / "a"), model, tiny_model_dir)
    on_disk = sum(os.path.getsize(tmp_path / "a" / f) for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
    assert written <= on_disk <= need  # the estimate bounds what PEFT writes
