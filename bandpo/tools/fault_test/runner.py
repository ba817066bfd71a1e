"""The fault test's driver: the reference run, the killed attempts, the checks, the report."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bandpo.shm.adapter_dirs import driver_adapter_dirs
from bandpo.shm.weight_files import driver_weight_files
from bandpo.tools.fault_test import checks
from bandpo.tools.fault_test.process import Session

ROOT = Path(__file__).resolve().parents[3]  # the repository (bandpo/tools/fault_test/runner.py)
TRAIN = ["bash", "scripts/train.sh"]
STEP_LINE = re.compile(r"^step (\d+)/\d+ \|", re.MULTILINE)  # MetricsLogger's console line
RESUMED = re.compile(r"\[bandpo\] resumed from (\S+) at step (\d+)")
# Overrides the fault test sets itself, or that would put workers out of its reach (an external cluster).
RESERVED = ("trainer.output_dir", "trainer.resume", "trainer.ray_address")


@dataclass
class Kill:
    """One SIGKILL of a whole attempt."""

    attempt: int
    mode: str  # checkpoint | step | startup
    at_s: float  # seconds after the attempt started
    detail: str
    mid_checkpoint: bool  # a checkpoint write of this attempt was under way (its temp folder remained)
    latest: str | None = None  # what checkpoints/latest named right after the kill
    survivors: list[str] = field(default_factory=list)


@dataclass
class Options:
    overrides: list[str]
    out: Path
    kills: int = 5
    seed: int = 0
    attempt_timeout_s: float = 3600.0
    poll_s: float = 0.005


class FaultTest:
    def __init__(self, opts: Options):
        bad = [o for o in opts.overrides if o.lstrip("+~").split("=", 1)[0] in RESERVED]
        if bad:
            raise ValueError(
                f"fault test: {', '.join(bad)} cannot be overridden (the fault test sets "
                f"{' and '.join(RESERVED[:2])} itself, and needs a local Ray instance it can kill)"
            )
        if opts.kills < 1:
            raise ValueError(f"fault test: --kills must be >= 1, got {opts.kills}")
        self.opts = opts
        self.out = opts.out.resolve()
        self.reference, self.killed, self.logs = (
            self.out / "reference",
            self.out / "killed",
            self.out / "logs",
        )
        self.rng = random.Random(opts.seed)
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.violations: list[str] = []
        self.kill_log: list[Kill] = []
        self.pids: list[int] = []

    # ------------------------------------------------------------------ the whole test
    def run(self) -> dict:
        for folder in (self.reference, self.killed, self.logs):  # this tool's own output folders
            shutil.rmtree(folder, ignore_errors=True)
        self.logs.mkdir(parents=True)
        t0 = time.monotonic()
        first_step_s = self._run_reference()
        ref_s = time.monotonic() - t0
        if self.violations:
            return self._report(ref_s, 0.0, [], 0)
        cfg = _run_config(self.reference)
        total, save_every = int(cfg["total_steps"]), int(cfg["save_every"])
        ref_rows = checks.read_metrics(self.reference)
        step_s = statistics.median([r["time/step"] for r in ref_rows if "time/step" in r] or [1.0])

        t1 = time.monotonic()
        attempts, completed = self._run_with_kills(
            self._plan(save_every), _saves(total, save_every), first_step_s, step_s
        )
        killed_s = time.monotonic() - t1
        if not completed:  # reported; nothing to compare
            return self._report(ref_s, killed_s, [], attempts)

        rows = checks.read_metrics(self.killed)
        self.violations += checks.check_steps(rows, ref_rows, total)
        self.violations += checks.check_step_metrics(rows, ref_rows)
        weight_problems, diff = checks.check_weights(self.killed, self.reference)
        self.violations += weight_problems
        latest_problems, latest = checks.check_latest(self.killed)
        self.violations += latest_problems
        if save_every and latest != f"step_{total:06d}":
            self.violations.append(f"checkpoints/latest names {latest}, expected step_{total:06d}")
        self.violations += checks.leftovers(self.killed)
        if save_every and not any(k.mid_checkpoint for k in self.kill_log):
            self.violations.append("no kill landed while a checkpoint was being written")
        self.violations += [
            f"{p} left in /dev/shm by a killed driver"
            for p in driver_weight_files(self.pids) + driver_adapter_dirs(self.pids)
        ]
        return self._report(ref_s, killed_s, rows, attempts, diff)

    def _plan(self, save_every: int) -> list[str]:
        """Kill modes in order: first a checkpoint write (while one is sure to come), then, shuffled,
        one during start-up (when there are 3 kills or more) and the others at random points of a step."""
        startup = 1 if self.opts.kills >= 3 else 0
        rest = ["startup"] * startup + ["step"] * (self.opts.kills - 1 - startup)
        self.rng.shuffle(rest)
        return (["checkpoint"] if save_every else ["step"]) + rest

    # ------------------------------------------------------------------ runs
    def _start(self, run_dir: Path, name: str) -> Session:
        cmd = [*TRAIN, *self.opts.overrides, f"trainer.output_dir={run_dir}", "trainer.resume=auto"]
        session = Session(cmd, self.logs / f"{name}.log", ROOT, self.env)
        self.pids.append(session.pid)
        return session

    def _run_reference(self) -> float:
        """The uninterrupted run; returns the seconds from its start to its first logged step."""
        session = self._start(self.reference, "reference")
        tail, first_step_s = _Tail(session.log_path), None
        while session.poll() is None and session.elapsed() < self.opts.attempt_timeout_s:
            if first_step_s is None and STEP_LINE.search(tail.read()):
                first_step_s = session.elapsed()
            time.sleep(0.5)
        if session.poll() is None:
            self.violations.append(
                f"the uninterrupted run did not finish in {self.opts.attempt_timeout_s:.0f} s"
            )
            session.kill()
        elif session.poll() != 0:
            self.violations.append(
                f"the uninterrupted run failed (exit {session.poll()}); see {session.log_path}:\n"
                + _last_lines(session.log_path)
            )
        self.violations += [f"orphan after the uninterrupted run exited: {p}" for p in session.leftovers()]
        return first_step_s or session.elapsed()

    def _run_with_kills(
        self, plan: list[str], saves: int, first_step_s: float, step_s: float
    ) -> tuple[int, bool]:
        """Attempts of the killed run until one exits; returns how many there were and whether it succeeded."""
        attempt = 0
        while attempt <= self.opts.kills + 1:
            attempt += 1
            latest_at_start = checks.check_latest(self.killed)[1] if self.killed.exists() else None
            session = self._start(self.killed, f"killed-{attempt}")
            mode = plan.pop(0) if plan else None
            kill = self._kill_when(session, mode, attempt, saves, first_step_s, step_s) if mode else None
            if kill is None:
                if session.poll() is None:  # no kill planned: wait for the end
                    try:
                        session.wait(timeout=max(self.opts.attempt_timeout_s - session.elapsed(), 1.0))
                    except subprocess.TimeoutExpired:
                        pass  # reported just below
                if session.poll() is None:
                    self.violations.append(
                        f"attempt {attempt} did not finish in {self.opts.attempt_timeout_s:.0f} s"
                    )
                    session.kill()
                    return attempt, False
                self._check_resume(session, attempt, latest_at_start)
                if session.poll() != 0:
                    self.violations.append(
                        f"attempt {attempt} failed (exit {session.poll()}); see "
                        f"{session.log_path}:\n" + _last_lines(session.log_path)
                    )
                self.violations += [
                    f"orphan after attempt {attempt} exited: {p}" for p in session.leftovers()
                ]
                return attempt, session.poll() == 0
            self.kill_log.append(kill)
            print(
                f"[fault_test] attempt {attempt}: killed {kill.detail} ({kill.at_s:.1f} s in); "
                f"latest = {kill.latest}",
                flush=True,
            )
            self._check_resume(session, attempt, latest_at_start)
            self.violations += [f"attempt {attempt}: still alive after SIGKILL: {p}" for p in kill.survivors]
            if mode == "checkpoint" and not kill.mid_checkpoint and plan:
                plan[0] = "checkpoint"  # the write finished before the kill landed: try again next time
        self.violations.append(f"the killed run did not complete within {attempt} attempts")
        return attempt, False

    def _kill_when(
        self, session: Session, mode: str, attempt: int, saves: int, first_step_s: float, step_s: float
    ) -> Kill | None:
        """Wait for the moment ``mode`` picks, then kill the session; None if it exited first."""
        ckpt = self.killed / "checkpoints"
        suffix = f"-{session.pid}"  # CheckpointManager names its temp folder after the driver's pid
        # From step 0, the 2nd write when there is one: then a previous checkpoint must survive it.
        target = min(2, saves) if attempt == 1 else 1
        startup_at = self.rng.uniform(min(3.0, 0.1 * first_step_s), 0.9 * first_step_s)
        tail, seen_tmp, fire_at, detail = _Tail(session.log_path), [], None, ""
        while True:
            if session.poll() is not None:
                return None
            now = session.elapsed()
            if now > self.opts.attempt_timeout_s:
                self.violations.append(
                    f"attempt {attempt} did not finish in {self.opts.attempt_timeout_s:.0f} s"
                )
                session.kill()
                return None
            if mode == "checkpoint":
                names = [n for n in _listdir(ckpt) if n.startswith(".tmp-step_") and n.endswith(suffix)]
                seen_tmp += [n for n in names if n not in seen_tmp]
                if len(seen_tmp) >= target:
                    detail = f"while writing {seen_tmp[-1]}"
                    break
            elif mode == "startup" and now >= startup_at:
                steps = STEP_LINE.findall(tail.read())
                detail = f"after step {steps[-1]} was logged" if steps else "during start-up"
                break
            elif mode == "step":
                if fire_at is None:
                    steps = STEP_LINE.findall(tail.read())
                    if steps:
                        delay = self.rng.uniform(0.0, 1.5 * step_s)
                        fire_at, detail = now + delay, f"{delay:.2f} s after step {steps[-1]} was logged"
                elif now >= fire_at:
                    break
            time.sleep(self.opts.poll_s if mode == "checkpoint" else 0.02)
        at = session.elapsed()
        survivors = session.kill()
        in_flight = [n for n in _listdir(ckpt) if n.startswith(".tmp-step_") and n.endswith(suffix)]
        problems, latest = checks.check_latest(self.killed)
        self.violations += [f"attempt {attempt} (killed {detail}): {p}" for p in problems]
        return Kill(attempt, mode, at, detail, bool(in_flight), latest, survivors)

    def _check_resume(self, session: Session, attempt: int, latest_at_start: str | None) -> None:
        """An attempt that got as far as training resumed from exactly the checkpoint ``latest`` named."""
        text = session.log_path.read_text(errors="replace")
        resumed = RESUMED.search(text)
        started = session.poll() == 0 or STEP_LINE.search(text) is not None
        got = Path(resumed.group(1)).name if resumed else None
        if (resumed or started) and got != latest_at_start:
            self.violations.append(
                f"attempt {attempt} resumed from {got or 'nothing'}, but checkpoints/latest "
                f"named {latest_at_start or 'nothing'} when it started"
            )

    # ------------------------------------------------------------------ report
    def _report(
        self,
        ref_s: float,
        killed_s: float,
        rows: list[dict],
        attempts: int,
        diff: float = float("nan"),
    ) -> dict:
        report = {
            "passed": not self.violations,
            "violations": self.violations,
            "kills": [asdict(k) for k in self.kill_log],
            "kills_requested": self.opts.kills,
            "attempts": attempts,
            "steps_logged": [r.get("step") for r in rows if checks.is_train_row(r)],
            "max_weight_diff": diff,
            "reference_s": round(ref_s, 1),
            "killed_run_s": round(killed_s, 1),
            "logs": str(self.logs),
        }
        (self.out / "fault_test.json").write_text(json.dumps(report, indent=2))
        return report


def summary(report: dict) -> str:
    lines = [
        (
            f"fault test: {len(report['kills'])} kills over {report['attempts']} attempts; "
            f"uninterrupted run {report['reference_s']} s, killed run {report['killed_run_s']} s"
        )
    ]
    if report["attempts"] and len(report["kills"]) < report["kills_requested"]:
        lines.append(
            f"  ({report['kills_requested'] - len(report['kills'])} planned kills did not happen: "
            f"the run ended first)"
        )
    for k in report["kills"]:
        where = " [mid-checkpoint]" if k["mid_checkpoint"] else ""
        lines.append(
            f"  attempt {k['attempt']}: {k['mode']:<10} killed {k['detail']} at {k['at_s']:.1f} s{where}; "
            f"latest = {k['latest']}"
        )
    lines.append(
        f"  steps logged: {report['steps_logged']}; final weights max abs diff: {report['max_weight_diff']:.3g}"
    )
    lines += [f"  VIOLATION: {v}" for v in report["violations"]]
    failed = f"FAILED ({len(report['violations'])} violations); logs in {report['logs']}"
    lines.append("PASSED" if report["passed"] else failed)
    return "\n".join(lines)


class _Tail:
    """The complete lines appended to a file since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> str:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return ""
        self.offset += len(data)
        data, cut = self.partial + data, (self.partial + data).rfind(b"\n") + 1
        self.partial = data[cut:]
        return data[:cut].decode(errors="replace")


def _run_config(run: Path) -> dict:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["trainer"]


def _saves(total: int, save_every: int) -> int:
    """Checkpoint writes of a run from step 0 (every ``save_every`` steps and at the last step)."""
    return sum(1 for s in range(1, total + 1) if save_every and (s % save_every == 0 or s == total))


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _last_lines(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
