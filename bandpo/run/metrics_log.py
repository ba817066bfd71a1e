"""Run logging: a console line per step, a JSONL metrics file, and wandb (offline by default).

The JSONL file is the source of truth: one object per step with a ``step`` key. On resume
the file is truncated to the checkpoint's step, so every step appears exactly once.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from bandpo.checkpoint.atomic import write_text_atomic

CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:+.3f}"),
    ("reward/accuracy", "acc", "{:.3f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/clip_frac_up", "clip+", "{:.4f}"),
    ("actor/clip_frac_down", "clip-", "{:.4f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
)


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | os.PathLike,
        total_steps: int,
        wandb_cfg: dict | None = None,
        run_config: dict | None = None,
    ):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.t0 = time.time()
        self.first_step: int | None = None
        self.wandb = None
        mode = (wandb_cfg or {}).get("mode", "disabled")
        if mode != "disabled":
            try:
                import wandb

                self.wandb = wandb.init(
                    project=wandb_cfg.get("project", "bandpo"),
                    mode=mode,
                    config=run_config,
                    dir=str(self.path.parent),
                    name=Path(output_dir).name,
                    resume="allow",
                )
            except Exception as e:  # logging must never kill a run
                print(f"[bandpo] wandb disabled: {e}")

    def truncate_after(self, step: int) -> None:
        """Drop what a resumed run will write again: lines of steps > ``step`` (written after the
        checkpoint we resume from), the end-of-run ``final`` line, and a line torn by a kill.
        ``step=-1`` empties the file (a fresh start)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # only the last line can be torn (appends are fsynced)
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step and not record.get("final"):
                keep.append(line)
        write_text_atomic(self.path, "".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self.first_step is None:
            self.first_step, self.t_first = step, time.time()
        self._console(step, metrics)

    def _console(self, step: int, metrics: dict[str, Any]) -> None:
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in CONSOLE_KEYS:
            if key in metrics and metrics[key] is not None:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        if "time/step" in metrics:
            done = step - self.first_step + 1
            per_step = (time.time() - self.t_first) / done + metrics["time/step"] / done
            parts.append(
                f"{metrics['time/step']:.1f}s/step ETA {per_step * (self.total_steps - step) / 60:.1f} min"
            )
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _json_value(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v
