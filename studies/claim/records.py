"""The claim test's run records read into typed rows: what the statistics (``stats``) and the report
(``report``) need of each recorded run, and nothing from a checkpoint (``protocol.md``: every
measurement is made inside the run and written to its small records).

A recorded run is a folder ``records/<test>/<arm>-s<seed>/`` holding ``metrics.jsonl`` (the trainer's
log, read with ``bandpo.viz.read_metrics``), ``config.yaml`` (the resolved config) and ``run.json``
(written last by ``run.py``: its presence marks the run recorded). From the metrics, per step:

- ``probe/entropy``: the fixed-text probe (token mean). The trainer logs the base policy's probe before
  the first step in a row of its own with ``step`` 0 (``Trainer.fit``: the step-0 probe and, with
  ``trainer.eval_before_train``, the step-0 evaluation share that row), then in the row of every step
  the probe is due (every ``probe.every`` steps and at the last), measured after that step's update;
- ``eval/<set>/mean@<n>``: the held-out evaluation (Test 1: steps 0 and 20), the set and n from the
  run's ``config.yaml``;
- ``actor/entropy``: the rollout entropy of every step's batch, and beside it (Test 2) its length check
  ``entropy/ended_first_n``, the training accuracy ``reward/accuracy`` and the share of groups without
  signal ``adv/zero_signal_group_frac`` (the pilot's gate).

Rows of one step are merged (a ``final`` row repeats the last step's number). The precision is
``actor.bf16`` resolved as the trainer resolves it (``bandpo.distributed.precision.resolve_bf16``) on the
machine ``run.json`` records: with ``auto`` on a CPU it is whether that CPU multiplies bf16 in hardware.
A record that lacks what a recorded run must hold raises ``RecordError`` naming the file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bandpo.data.datasets import display_name
from bandpo.distributed.precision import resolve_bf16
from bandpo.viz import read_metrics

PROBE = "probe/entropy"
ROLLOUT = "actor/entropy"
FIRST_N = "entropy/ended_first_n"
ACCURACY = "reward/accuracy"
ZERO_SIGNAL = "adv/zero_signal_group_frac"
RUN_NAME = re.compile(r"^(?P<arm>[a-z0-9_]+)-s(?P<seed>\d+)$")


class RecordError(ValueError):
    """A run's records lack something a recorded run must hold; the message names the file."""


@dataclass(frozen=True)
class Run:
    """One recorded run: the measurements the report reads, and where and how it ran."""

    arm: str
    seed: int
    folder: Path
    probe: dict[int, float]  # step -> probe/entropy (step 0: the base policy)
    eval_key: str  # eval/<set>/mean@<n>
    evals: dict[int, float]  # step -> held-out mean@n (Test 1: steps 0 and 20)
    rollout: dict[int, float] = field(default_factory=dict)  # step -> actor/entropy
    first_n: dict[int, float] = field(default_factory=dict)  # step -> entropy/ended_first_n
    accuracy: dict[int, float] = field(default_factory=dict)  # step -> reward/accuracy (training)
    zero_signal: dict[int, float] = field(default_factory=dict)  # step -> adv/zero_signal_group_frac
    cpu: str = "unknown CPU"
    fast_bf16: bool = False  # the CPU multiplies bf16 in hardware
    bf16: bool = False  # actor.bf16 resolved on that machine
    wall_s: float | None = None
    commit: str = ""

    @property
    def name(self) -> str:
        return f"{self.arm}-s{self.seed}"

    @property
    def machine(self) -> tuple[str, bool]:
        """The machine kind two arms of a pair must share (protocol.md: "Both arms of a seed run on the
        same machine kind"): the CPU's name and whether it multiplies bf16 in hardware."""
        return (self.cpu, self.fast_bf16)

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    @property
    def machine_label(self) -> str:
        return f"{self.cpu} ({'bf16 in hardware' if self.fast_bf16 else 'no hardware bf16'})"


def _number(value, path: Path, step: int, key: str) -> float:
    """A logged number as a float; the trainer writes a non-finite one as a string ("nan")."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise RecordError(f"{path}: step {step}: {key} is {value!r}, not a number")
    try:
        out = float(value)
    except ValueError:
        raise RecordError(f"{path}: step {step}: {key} is {value!r}, not a number") from None
    if not math.isfinite(out):
        raise RecordError(f"{path}: step {step}: {key} is {value!r}; the run's records are not usable")
    return out


def _series(rows: dict[int, dict], key: str, path: Path) -> dict[int, float]:
    return {step: _number(row[key], path, step, key) for step, row in sorted(rows.items()) if key in row}


def _load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordError(f"{path}: missing") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: not a JSON object")
    return data


def _load_config(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise RecordError(f"{path}: missing") from None
    except yaml.YAMLError as e:
        raise RecordError(f"{path}: not YAML ({e})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: not a mapping")
    return data


def _eval_key(config: dict, path: Path) -> str:
    """``eval/<first set>/mean@<eval.n>``: the held-out number the trainer logs (``bandpo.eval``), the set
    named as the trainer names it (a file in eval.datasets by its stem: Test 2's held-out set)."""
    try:
        sets, n = config["eval"]["datasets"], config["eval"]["n"]
        return f"eval/{display_name(str(sets[0]))}/mean@{n}"
    except (KeyError, IndexError, TypeError):
        raise RecordError(f"{path}: no eval.datasets / eval.n") from None


def _resolved_bf16(config: dict, fast_bf16: bool, path: Path) -> bool:
    try:
        setting, device = config["actor"]["bf16"], config["trainer"]["device"]
    except (KeyError, TypeError):
        raise RecordError(f"{path}: no actor.bf16 / trainer.device") from None
    if setting == "auto" and device not in ("cpu", "cuda"):
        raise RecordError(f"{path}: actor.bf16=auto with trainer.device={device!r}: precision unknown")
    try:
        return resolve_bf16(setting, device, fast_cpu_bf16=fast_bf16)
    except ValueError as e:
        raise RecordError(f"{path}: {e}") from None


def _check_lines(path: Path) -> None:
    """Every line of a recorded run's metrics is a JSON object. ``read_metrics`` skips a line it cannot
    parse (a line torn by a crash mid-write); a run is recorded only once it has ended, and the trainer
    drops a torn line when it resumes, so in a record such a line is damage and is refused."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}: line {number} is not JSON ({e})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise RecordError(f"{path}: line {number} is not a metrics row (a JSON object with a step)")


def read_run(folder: Path, steps: int) -> Run:
    """One recorded run; ``steps`` is the test's length (the probe must be logged at 0 and ``steps``)."""
    folder = Path(folder)
    match = RUN_NAME.match(folder.name)
    if not match:
        raise RecordError(f"{folder}: not a run folder name (<arm>-s<seed>)")
    arm, seed = match["arm"], int(match["seed"])
    info_path, config_path, metrics_path = (
        folder / "run.json",
        folder / "config.yaml",
        folder / "metrics.jsonl",
    )
    info = _load_json(info_path)
    if info.get("arm", arm) != arm or info.get("seed", seed) != seed:
        raise RecordError(
            f"{info_path}: arm/seed {info.get('arm')}/{info.get('seed')} != folder {folder.name}"
        )
    machine = info.get("machine")
    if not isinstance(machine, dict) or "cpu" not in machine or "fast_bf16" not in machine:
        raise RecordError(f"{info_path}: no machine (cpu, fast_bf16)")
    config = _load_config(config_path)
    if not metrics_path.exists():
        raise RecordError(f"{metrics_path}: missing")
    _check_lines(metrics_path)
    rows: dict[int, dict] = {}
    for row in read_metrics(metrics_path):  # sorted by step; a torn last line is skipped
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise RecordError(f"{metrics_path}: a row's step is {step!r}, not an integer")
        rows.setdefault(step, {}).update(row)
    probe = _series(rows, PROBE, metrics_path)
    for step in (0, steps):
        if step not in probe:
            where = "the base policy's row (step 0)" if step == 0 else f"step {step}'s row"
            raise RecordError(f"{metrics_path}: no {PROBE} in {where}")
    if probe[0] <= 0 or probe[steps] <= 0:
        raise RecordError(
            f"{metrics_path}: {PROBE} must be positive (steps 0, {steps}: {probe[0]}, {probe[steps]})"
        )
    eval_key = _eval_key(config, config_path)
    wall = info.get("wall_s")
    return Run(
        arm=arm,
        seed=seed,
        folder=folder,
        probe=probe,
        eval_key=eval_key,
        evals=_series(rows, eval_key, metrics_path),
        rollout=_series(rows, ROLLOUT, metrics_path),
        first_n=_series(rows, FIRST_N, metrics_path),
        accuracy=_series(rows, ACCURACY, metrics_path),
        zero_signal=_series(rows, ZERO_SIGNAL, metrics_path),
        cpu=str(machine["cpu"]),
        fast_bf16=bool(machine["fast_bf16"]),
        bf16=_resolved_bf16(config, bool(machine["fast_bf16"]), config_path),
        wall_s=float(wall) if isinstance(wall, int | float) else None,
        commit=str(info.get("commit", "")),
    )


def read_test(folder: Path, steps: int) -> list[Run]:
    """Every recorded run under ``folder`` (``records/<test>``), by arm then seed; a folder without
    ``run.json`` is not recorded yet and left out; none (or no folder) gives []."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    runs = [read_run(sub, steps) for sub in sorted(folder.iterdir()) if (sub / "run.json").exists()]
    return sorted(runs, key=lambda r: (r.arm, r.seed))
