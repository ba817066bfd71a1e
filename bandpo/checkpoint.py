"""Run checkpoints: atomic step folders, a ``latest`` pointer written last, keep the last k.

Layout of ``<output_dir>/checkpoints``::

    step_000010/              complete checkpoint (renamed into place only once written)
      actor/                  DeepSpeed state of every rank (model, optimizer, scheduler, RNG)
      trainer_state.json      step, sampler position, driver RNG, metrics-log position
    latest                    text file naming the newest complete step folder
    .tmp-step_000012-<pid>/   a write in progress; never picked up, removed on the next save

A kill at any moment leaves either the previous ``latest`` or the new one, never a
half-written folder that resume would read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

STEP_RE = re.compile(r"^step_(\d{6,})$")


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or new entry inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file + fsync + rename, so readers see the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class CheckpointManager:
    """Saves and finds run checkpoints under ``root``."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3):
        self.root = Path(root)
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None. A stale or corrupt pointer raises, naming the file."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        folder = self.root / name
        if not STEP_RE.match(name) or not (folder / "trainer_state.json").exists():
            raise RuntimeError(f"checkpoint pointer {pointer} names {name!r}, which is not a complete checkpoint")
        return folder

    def save(self, step: int, write_actor: Callable[[Path], None], trainer_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step``: actor state via ``write_actor(folder)``, then the trainer state."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-step_*"):  # a write that was killed
            shutil.rmtree(stale, ignore_errors=True)
        name = f"step_{step:06d}"
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        tmp.mkdir()
        write_actor(tmp / "actor")
        state_file = tmp / "trainer_state.json"
        with open(state_file, "w") as fh:
            json.dump(trainer_state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        final = self.root / name
        if final.exists():  # the same step saved before a crash that lost `latest`
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(self.root / "latest", name)
        self._prune()
        return final

    def load_state(self, folder: Path) -> dict[str, Any]:
        try:
            return json.loads((folder / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RuntimeError(f"corrupt checkpoint {folder}: trainer_state.json unreadable ({e})") from None

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.iterdir() if STEP_RE.match(p.name))
        for old in steps[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
