"""The tiny-arith build's cache check and the trainer's ``model.build`` entry; nothing is trained here."""

import json

import pytest

from bandpo.models import tiny_arith


def _fake_cached(folder, args):
    folder.mkdir(parents=True)
    (folder / tiny_arith.MARKER).write_text(json.dumps({"hash": tiny_arith._args_hash(args)}))


@pytest.fixture
def no_build(monkeypatch):
    def fail(*_args, **_kwargs):
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(tiny_arith, "_build_into", fail)


def test_a_current_folder_is_returned_at_once(tmp_path, no_build):
    _fake_cached(tmp_path / "model", tiny_arith.BuildArgs(sft_steps=7, hidden_size=64))
    assert tiny_arith.build(tmp_path / "model", sft_steps=7, hidden_size=64) == tmp_path / "model"


def test_the_hash_covers_every_argument():
    base = tiny_arith._args_hash(tiny_arith.BuildArgs())
    assert tiny_arith._args_hash(tiny_arith.BuildArgs()) == base
    assert tiny_arith._args_hash(tiny_arith.BuildArgs(lr=1e-3)) != base


def test_a_foreign_folder_is_never_replaced(tmp_path, no_build):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="not a tiny-arith model folder"):
        tiny_arith.build(tmp_path / "model")


def test_ensure_model_builds_through_the_package(tmp_path, no_build):
    from dataclasses import replace

    from bandpo.config.schema import ModelConfig
    from bandpo.parts import ensure_model

    _fake_cached(tmp_path / "model", tiny_arith.BuildArgs(sft_steps=3))
    cfg = ModelConfig(
        name="tiny", path=str(tmp_path / "model"), build="tiny_arith", build_args={"sft_steps": 3}
    )
    assert ensure_model(cfg) == str(tmp_path / "model")
    with pytest.raises(ValueError, match="not a known recipe; valid: tiny_arith"):
        ensure_model(replace(cfg, build="other"))
    with pytest.raises(ValueError, match=r"build_args.sft_step is not an argument .*valid: \[.*'sft_steps'"):
        ensure_model(replace(cfg, build_args={"sft_step": 3}))
