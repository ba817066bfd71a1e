"""Run checkpoints: atomic step folders, a ``latest`` pointer written last, keep the last k.

Layout of ``<output_dir>/checkpoints``::

    step_000010/              complete checkpoint (renamed into place only once written)
      actor/                  every actor rank's state (``bandpo.checkpoint.actor_state``): DeepSpeed's
        state/                  model, optimizer and scheduler shards; rng_rank<r>.pt beside it
      trainer_state.json      step, sampler position, skipped-step count, the adaptive entropy bonus' state (the trainer's ``save``)
      in_flight.pt            trainer.max_staleness=1: the next step's batch, drawn ahead (absent otherwise)
    latest                    text file naming the newest complete step folder
    .tmp-step_000012-<pid>/   a write in progress; never picked up, removed on the next save
                              (or resume, or when the write fails)

A kill at any moment leaves either the previous ``latest`` or the new one, never a
half-written folder that resume would read. A step folder exists only once complete, so
when a kill lands between its rename and the pointer update, ``latest()`` falls back to
the newest step folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bandpo.checkpoint.atomic import fsync_dir, write_text_atomic

STEP_RE = re.compile(r"^step_(\d{6,})$")
ACTOR_DIR = "actor"  # step_N/actor: the actor ranks' checkpoint
CKPT_TAG = "state"  # DeepSpeed's sub-folder inside an actor checkpoint (step_N/actor/state/*.pt)
IN_FLIGHT_FILE = "in_flight.pt"


def save_in_flight(obj: Any, path: Path) -> None:
    """Pickle the batch drawn ahead (``bandpo.trainer.overlap.InFlight``) into ``path``, fsynced
    (inside the checkpoint's temporary folder: the rename makes it visible)."""
    import torch

    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def load_in_flight(path: Path, types: Sequence[type]) -> Any:
    """The batch ``save_in_flight`` wrote, or None without the file; an unreadable one raises, naming it.

    Loaded with ``weights_only=True``: ``types`` are the classes the batch is made of (the trainer's
    dataclasses), any other pickled global is refused (``bandpo.checkpoint.safe_load``).
    """
    from bandpo.checkpoint import safe_load
    from bandpo.errors import UnsafeCheckpoint

    if not path.exists():
        return None
    try:
        return safe_load.load(path, types)
    except UnsafeCheckpoint:
        raise
    except Exception as e:
        raise RuntimeError(f"corrupt checkpoint: {path} is unreadable ({e})") from None


class CheckpointManager:
    """Saves and finds run checkpoints under ``root``."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3):
        self.root = Path(root)
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None. A stale or corrupt pointer raises, naming the file.

        Without a pointer, the newest step folder (one is renamed into place only when complete).
        """
        pointer = self.root / "latest"
        if not pointer.exists():
            steps = self._steps()
            return steps[-1] if steps else None
        name = pointer.read_text().strip()
        folder = self.root / name
        if not STEP_RE.match(name) or not (folder / "trainer_state.json").exists():
            raise RuntimeError(
                f"checkpoint pointer {pointer} names {name!r}, which is not a complete checkpoint "
                f"(delete the pointer to fall back to the newest step folder)"
            )
        return folder

    def remove_stale(self) -> None:
        """Delete what writes that were killed or failed left: step folders and pointer temp files."""
        if not self.root.is_dir():
            return
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.root.glob(".latest.tmp-*"):  # write_text_atomic's temp file
            stale.unlink(missing_ok=True)

    def save(self, step: int, write_actor: Callable[[Path], None], trainer_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step``: actor state via ``write_actor(folder)``, then the trainer state.

        If anything fails (a full disk, a dead worker), the temporary folder is removed and the
        error re-raised; ``latest`` still names the previous checkpoint.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_stale()
        name = f"step_{step:06d}"
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        tmp.mkdir()
        try:
            write_actor(tmp / ACTOR_DIR)
            with open(tmp / "trainer_state.json", "w") as fh:
                json.dump(trainer_state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.root / name
        if final.exists():  # the same step saved before a crash that lost `latest`
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(self.root / "latest", name)
        self._prune()
        return final

    def load_state(self, folder: Path, required: tuple[str, ...] = ("step",)) -> dict[str, Any]:
        """The trainer state saved in ``folder``; a missing, unreadable or incomplete file raises, naming it."""
        file = folder / "trainer_state.json"
        try:
            state = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RuntimeError(f"corrupt checkpoint: {file} is unreadable ({e})") from None
        missing = [k for k in required if not isinstance(state, dict) or k not in state]
        if missing:
            raise RuntimeError(f"corrupt checkpoint: {file} lacks {', '.join(missing)}")
        return state

    def _steps(self) -> list[Path]:
        """Complete step folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(
            p for p in self.root.iterdir() if STEP_RE.match(p.name) and (p / "trainer_state.json").exists()
        )

    def _prune(self) -> None:
        for old in self._steps()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
