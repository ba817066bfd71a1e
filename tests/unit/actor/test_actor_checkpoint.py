"""Actor checkpoints without a rank doing the slow part alone: every rank flushes its own writes,
rank 0 only renames; the HF export's weight files are written by the ranks in turn; the process
group's timeout comes from the config. No DeepSpeed: the engine is a stand-in that writes files.
"""

from __future__ import annotations

import sys
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from bandpo.actor.worker import Actor
from bandpo.checkpoint import atomic, hf_export


def test_init_distributed_passes_the_configured_timeout(monkeypatch):
    from bandpo.actor.setup import init_distributed

    seen = {}
    fake = types.SimpleNamespace(init_distributed=lambda **kw: seen.update(kw))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    # An earlier in-process test may have joined a process group of its own: this one is a new rank.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(1, 2, 0, "127.0.0.1", 29999, "gloo", timeout_min=90)
    assert seen["timeout"] == timedelta(minutes=90) and seen["dist_backend"] == "gloo"


class _Engine:
    """Writes what DeepSpeed would: a shard per rank into the checkpoint folder."""

    def __init__(self, rank: int, log: list):
        self.rank, self.log = rank, log

    def save_checkpoint(self, folder, tag, client_state, save_latest):
        Path(folder, tag).mkdir(parents=True, exist_ok=True)
        Path(folder, tag, f"shard_{self.rank}.pt").write_bytes(b"x" * 10)
        self.log.append((self.rank, "write"))


@pytest.mark.parametrize("rank", [0, 1])
def test_save_checkpoint_every_rank_flushes_its_writes_and_rank0_only_renames(tmp_path, monkeypatch, rank):
    log: list = []
    actor = types.SimpleNamespace(
        rank=rank, engine=_Engine(rank, log), _barrier=lambda: log.append((rank, "barrier"))
    )
    monkeypatch.setattr(atomic, "sync_filesystem", lambda path: log.append((rank, "flush", Path(path).name)))
    monkeypatch.setattr(atomic, "publish", lambda tmp, path: log.append((rank, "rename")))
    Actor.save_checkpoint(actor, str(tmp_path / "ckpt"), {"step": 1})
    steps = [e[1] for e in log]
    # the flush is this rank's own, after its writes and before the barrier rank 0 renames after
    assert steps == ["barrier", "write", "flush", "barrier"] + (["rename"] if rank == 0 else []) + ["barrier"]
    assert log[2][2] == "ckpt.tmp"


def test_sync_filesystem_flushes_or_names_the_path(tmp_path):
    (tmp_path / "f").write_text("x")
    atomic.sync_filesystem(tmp_path)
    with pytest.raises(FileNotFoundError):
        atomic.sync_filesystem(tmp_path / "missing")


def test_publish_replaces_the_previous_folder(tmp_path):
    old, new = tmp_path / "ckpt", tmp_path / "ckpt.tmp"
    old.mkdir()
    (old / "a").write_text("old")
    (new / "sub").mkdir(parents=True)
    (new / "sub" / "a").write_text("new")
    atomic.publish(new, old)
    assert (
        (old / "sub" / "a").read_text() == "new" and not new.exists() and not (tmp_path / "ckpt.old").exists()
    )


def test_hf_folder_weight_files_are_written_by_the_ranks_in_turn(tiny_model_dir, tmp_path):
    """Two ranks drain the same buckets; each writes every other weight file, rank 0 the config,
    index and tokenizer; together they load as the model's exact weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    buckets = [params[i : i + 4] for i in range(0, len(params), 4)]
    assert len(buckets) >= 3
    out = tmp_path / "hf"
    out.mkdir()
    written = {r: hf_export.save_hf_folder(model, iter(buckets), out, tiny_model_dir, r, 2) for r in (1, 0)}
    weights = {r: sorted(p.name for p in written[r] if p.suffix == ".safetensors") for r in written}
    assert weights[1] == [f"model-{i + 1:05d}.safetensors" for i in range(1, len(buckets), 2)]
    assert weights[0] == [f"model-{i + 1:05d}.safetensors" for i in range(0, len(buckets), 2)]
    assert {"config.json", "model.safetensors.index.json", "tokenizer_config.json"} <= {
        p.name for p in written[0]
    }
    assert sorted(p.name for p in out.iterdir()) == sorted({p.name for w in written.values() for p in w})
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    got = dict(exported.named_parameters())
    assert got.keys() == dict(params).keys()
    for name, t in params:
        assert torch.equal(got[name], t), name


def test_hf_folder_of_one_bucket_is_one_model_safetensors(tiny_model_dir, tmp_path):
    """A model that fits one bucket is exported as save_pretrained writes it: ``model.safetensors``,
    no index (what scripts and the final-weights checks of a run read)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    out = tmp_path / "hf"
    out.mkdir()
    written = hf_export.save_hf_folder(model, iter([params]), out, tiny_model_dir, 0, 1)
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    assert not any(n.startswith("model-") for n in names) and out / "model.safetensors" in written
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == dict(params).keys() and all(torch.equal(got[n], t) for n, t in params)
