"""Shared fixtures. Integration tests run the real engines on CPU; `gpu` tests need CUDA. The summary
ends with the time spent in each part of the suite (unit, integration, study, benchmark).

Hypothesis runs the "ci" profile (a fixed, derandomized set of examples, so two runs check the same
inputs); HYPOTHESIS_PROFILE=thorough draws many more, fresh ones each run."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
from hypothesis import settings

# deadline=None: an example's time depends on the machine's load and on caches (the KL band builds a
# table per new delta), not on the code under test.
settings.register_profile("ci", max_examples=50, derandomize=True, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Engines read these at import/initialisation; set them before any test imports one.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of RAM for the KV cache
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


# tests/<folder>/ -> the marker every test in it gets, so that its time is reported apart and
# `-m "not <marker>"` leaves it out: the studies' tests (studies/) and the benchmarks' (benchmarks/).
FOLDER_MARKERS = {"tests/studies/": "study", "tests/benchmarks/": "benchmark"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        for folder, marker in FOLDER_MARKERS.items():
            if item.nodeid.startswith(folder):
                item.add_marker(marker)
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


_TORCH_THREADS: list[int] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """One intra-op torch thread for every test that starts no engine; integration tests get the
    process's default back. The tests that start no engine compute on small tensors, where a second
    OpenMP thread buys little and its waiting costs much: on 2 cores shared with other jobs (load
    average ~25) a KL band table took 1.8 s of CPU with 2 threads and 0.18 s with 1. Set before the
    test's fixtures, so module-scoped ones (an engine, a model) are built under the same count."""
    import torch

    if not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    torch.set_num_threads(_TORCH_THREADS[0] if item.get_closest_marker("integration") else 1)


# The suite's parts, by marker (the first that applies); a test with none of them is a unit test.
PARTS = ("integration", "study", "benchmark")
_SECONDS: dict[str, float] = defaultdict(float)
_COUNTS: dict[str, int] = defaultdict(int)


def _part(keywords) -> str:
    return next((p for p in PARTS if p in keywords), "unit")


def pytest_runtest_logreport(report):
    part = _part(report.keywords)
    _SECONDS[part] += report.duration  # setup, call and teardown each
    _COUNTS[part] += report.when == "call"


def pytest_terminal_summary(terminalreporter):
    if _SECONDS:
        parts = sorted(_SECONDS, key=("unit", *PARTS).index)
        line = ", ".join(f"{p} {_COUNTS[p]} tests {_SECONDS[p]:.1f} s" for p in parts)
        terminalreporter.write_line(f"time by part (setup + call + teardown): {line}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 model + tokenizer folder (HF format), built once per session."""
    from bandpo.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model")))
