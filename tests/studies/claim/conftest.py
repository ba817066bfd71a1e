"""Made-up records for the claim study's tests (Test 1's by default, Test 2's with ``test="learn"``): the ``write_run`` fixture writes one run's folder as
``studies/claim/run.py`` keeps it (metrics.jsonl as the trainer logs it, config.yaml, run.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CPU = "AMD EPYC 7B13"


def _write_run(
    root: Path,
    arm: str,
    seed: int,
    probe: dict[int, float],
    evals: dict[int, float] | None = None,
    cpu: str = CPU,
    fast_bf16: bool = False,
    bf16: bool | str = False,
    wall_s: float = 3000.0,
    steps: int = 20,
    test: str = "random",
    series: dict[str, dict[int, float]] | None = None,
    eval_set: str = "tiny_arith_test",
) -> Path:
    """``root/<test>/<arm>-s<seed>/``: a step-0 row (the base policy's probe and evaluation, as
    ``Trainer.fit`` logs it), one row per step with ``actor/entropy`` (0.5 + step / 100 unless ``series``
    gives it), the probe and evaluation where given, and any other ``series`` (key -> step -> value).
    ``eval_set`` is eval.datasets' entry (a file's path names the set by its stem)."""
    folder = root / test / f"{arm}-s{seed}"
    folder.mkdir(parents=True)
    evals = evals or {}
    key = f"eval/{Path(eval_set).stem}/mean@8"
    rows = []
    for step in range(steps + 1):
        row: dict = {"step": step}
        if step:
            row["actor/entropy"] = 0.5 + step / 100
        for name, values in (series or {}).items():
            if step in values:
                row[name] = values[step]
        if step in probe:
            row["probe/entropy"] = probe[step]
        if step in evals:
            row[key] = evals[step]
        if len(row) > 1:
            rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bf16_yaml = bf16 if isinstance(bf16, str) else str(bf16).lower()
    (folder / "config.yaml").write_text(
        f"actor:\n  bf16: {bf16_yaml}\ntrainer:\n  device: cpu\n  total_steps: {steps}\n"
        f"eval:\n  datasets:\n  - {eval_set}\n  'n': 8\n"
    )
    record = {
        "test": test, "arm": arm, "seed": seed, "machine": {"cpu": cpu, "fast_bf16": fast_bf16, "cores": 2},
        "commit": "abc123", "wall_s": wall_s,
    }  # fmt: skip
    (folder / "run.json").write_text(json.dumps(record))
    return folder


@pytest.fixture
def records(tmp_path) -> Path:
    return tmp_path / "records"


@pytest.fixture
def write_run():
    """``write_run(root, arm, seed, probe, evals=None, ...)``: one run's record folder (``_write_run``)."""
    return _write_run
