"""/dev/shm hygiene: remove vLLM's shared-memory files that this project's dead runs left behind.

vLLM's engines create message-queue buffers (``psm_*``, 100-250 MB apparent size each) and
multiprocessing semaphores (``sem.mp-*``) in /dev/shm and remove them only in their own
clean shutdown; a run that is killed (SIGKILL, OOM, a node's job limit) leaves them there,
in RAM, until reboot. Their names are random, so nothing tells whose they are afterwards.

So a run records, while it is alive, the entries that appeared while its engines started
and that a process of this run holds open or mapped (``record_new_entries``), together with
those processes' ids, in ``<run>/logs/shm.json`` and in a per-user index. At the next start
(``clean_shm``: ``remove_dead_entries``) a recorded entry is removed only when every process recorded for
it is gone and no process on the node still holds it: files of other users, other programs
and live runs are never touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PATTERNS = ("psm_*", "sem.mp-*")
INDEX_DIR = Path(os.environ.get("BANDPO_SHM_INDEX", Path.home() / ".cache" / "bandpo" / "shm"))


def snapshot(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of the vLLM-style entries in ``shm_dir`` now."""
    return {p.name for pattern in PATTERNS for p in shm_dir.glob(pattern)}


def holders(paths: set[str], pids) -> dict[str, list[int]]:
    """For each path in ``paths``: the processes among ``pids`` that have it open or mapped."""
    out: dict[str, list[int]] = {}
    for pid in pids:
        held = set()
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    held.add(os.readlink(fd.path))
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.split(None, 5)[-1].strip() for line in f if "/" in line)
        except OSError:  # gone, or not ours to read
            continue
        for path in paths & held:
            out.setdefault(path, []).append(pid)
    return out


def _our_pids() -> list[int]:
    """This process and all its descendants (a local Ray instance's workers are among them)."""
    import psutil

    me = psutil.Process()
    return [me.pid] + [p.pid for p in me.children(recursive=True)]


def record_new_entries(
    run_dir: Path, before: set[str], shm_dir: Path = SHM_DIR, pids=None
) -> dict[str, list[int]]:
    """Record the entries new since ``before`` that this run's processes hold; returns them."""
    new = {str(shm_dir / name) for name in snapshot(shm_dir) - before}
    owned = holders(new, _our_pids() if pids is None else pids) if new else {}
    if owned:
        text = json.dumps({"driver": os.getpid(), "entries": owned}, indent=1)
        for path in (Path(run_dir) / "logs" / "shm.json", INDEX_DIR / f"{os.getpid()}.json"):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
    return owned


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (it may be another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_entries(run_dir: Path | None = None) -> list[str]:
    """Remove recorded entries whose processes are all gone; returns the removed paths.

    Reads ``<run_dir>/logs/shm.json`` and the per-user index; a record none of whose
    entries is left (removed, or still held by someone) is dropped from the index.
    """
    records = sorted(INDEX_DIR.glob("*.json")) if INDEX_DIR.is_dir() else []
    if run_dir is not None and (Path(run_dir) / "logs" / "shm.json").exists():
        records.append(Path(run_dir) / "logs" / "shm.json")
    entries: dict[Path, dict[str, list[int]]] = {}
    for record in records:
        try:
            entries[record] = json.loads(record.read_text())["entries"]
        except (OSError, ValueError, KeyError):
            continue
    orphans = {
        path
        for found in entries.values()
        for path, pids in found.items()
        if os.path.exists(path) and not any(alive(p) for p in pids)
    }
    if orphans:  # one pass over every process on the node: is any of them still using one?
        orphans -= set(holders(orphans, [int(p) for p in os.listdir("/proc") if p.isdigit()]))
    removed = []
    for path in sorted(orphans):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # not ours after all, or removed meanwhile
            pass
    for record, found in entries.items():
        if record.parent == INDEX_DIR and not any(os.path.exists(path) for path in found):
            record.unlink(missing_ok=True)
    return removed


def clean_shm(run_dir: Path) -> set[str]:
    """Remove vLLM /dev/shm files of this project's dead runs (``remove_dead_entries``); the entries left now."""
    removed = remove_dead_entries(run_dir)
    if removed:
        print(f"[bandpo] removed {len(removed)} /dev/shm files left by dead bandpo runs", flush=True)
    return snapshot()
