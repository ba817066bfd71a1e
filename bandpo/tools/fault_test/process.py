"""A command in its own session (``setsid``), killed as a whole.

A training run is a tree of processes: the driver, Ray's GCS and raylet, one worker process
per Ray actor, vLLM's engine-core processes under each rollout worker, the verifier pool.
Killing the driver alone orphans the rest (they hold the CPU, RAM and /dev/shm the next
attempt needs). All of them inherit the driver's session, so a session is the unit to kill;
processes that were seen as descendants are killed too, in case one left the session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil


class Session:
    """Start ``cmd`` as the leader of a new session, its output going to ``log_path``."""

    def __init__(self, cmd: list[str], log_path: Path, cwd: Path, env: dict[str, str]):
        self.log_path = log_path
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.sid = self.proc.pid
        self.started = time.monotonic()
        self._seen: dict[int, psutil.Process] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def members(self) -> list[psutil.Process]:
        """Live (non-zombie) processes of the session, plus descendants seen before that left it."""
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.sid:
                    found[p.pid] = p
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        try:
            for p in psutil.Process(self.pid).children(recursive=True):
                found.setdefault(p.pid, p)
        except psutil.Error:
            pass
        self._seen.update(found)
        return [p for p in self._seen.values() if _alive(p)]

    def kill(self, grace_s: float = 30.0) -> list[str]:
        """SIGKILL every process of the session; returns descriptions of any still alive after ``grace_s``.

        Repeats until none is left, since a process can start between a listing and the kill.
        """
        deadline = time.monotonic() + grace_s
        while True:
            try:
                os.killpg(self.sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            left = self.members()
            for p in left:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            self._reap()
            if not left:
                return []
            if time.monotonic() > deadline:
                return [describe(p) for p in left if _alive(p)]
            time.sleep(0.2)

    def leftovers(self, grace_s: float = 30.0) -> list[str]:
        """After the leader exited on its own: processes of the session still alive after ``grace_s``
        (an orphan a clean exit should not leave); they are killed."""
        deadline = time.monotonic() + grace_s
        while self.members() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [describe(p) for p in self.members()]
        if left:
            self.kill()
        return left

    def _reap(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:120] or p.name()}"
    except psutil.Error:
        return f"pid {p.pid}"
