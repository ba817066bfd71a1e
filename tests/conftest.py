"""Shared fixtures. Integration tests run the real engines on CPU; `gpu` tests need CUDA."""

from __future__ import annotations

import os

import pytest

# Engines read these at import/initialisation; set them before any test imports one.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of RAM for the KV cache
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def pytest_collection_modifyitems(config, items):
    import torch

    # tests/integration/ is the engine tree: each file there says `pytestmark = pytest.mark.integration`,
    # so that `-m "not integration"` (the fast unit suite) never starts an engine.
    unmarked = [
        i.nodeid
        for i in items
        if i.nodeid.startswith("tests/integration/") and i.get_closest_marker("integration") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests under tests/integration/ without the integration marker: " + ", ".join(unmarked)
        )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 model + tokenizer folder (HF format), built once per session."""
    from bandpo.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model")))
