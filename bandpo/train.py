"""Training entry point: ``python -m bandpo.train [hydra overrides...]`` (what scripts/train.sh runs).

The config is composed and validated before any worker starts, so a bad override fails in
seconds naming the key (exit code 2), and so does an input that cannot be read (a data file,
a broken row, a dataset or model given by hub id that is neither reachable nor cached:
``InputError``, read before Ray starts); a worker that dies stops the run (exit code 1) with a
message naming the worker, the stage and the last complete checkpoint. After training it
writes ``curves.png`` (reward, accuracy, held-out mean@n, entropy, clip fraction per step)
into the run folder and prints a summary: the held-out metrics before the first step and
after the last one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig


def main(argv: list[str] | None = None) -> int:
    from bandpo.config import compose
    from bandpo.errors import ConfigError

    try:
        cfg = compose(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if cfg.trainer.dry_run:
        return dry_run(cfg)
    from bandpo.errors import InputError, VerifierUnavailable, WorkerFailure
    from bandpo.trainer.loop import train

    try:
        train(cfg)
    except ConfigError as e:  # found at start-up: model.build, the placement plan on the live cluster
        print(e, file=sys.stderr)
        return 2
    except InputError as e:  # names the key, the file/row or hub id, and what to give instead
        print(f"input error: {e}", file=sys.stderr)
        return 2
    except WorkerFailure as e:  # already names the worker, the stage and the checkpoint to resume from
        print(f"[bandpo] run stopped: {e}", file=sys.stderr)
        return 1
    # a broken verifier; NaN/inf under on_nonfinite=stop
    except (VerifierUnavailable, FloatingPointError) as e:
        print(f"[bandpo] run stopped: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    out = Path(cfg.trainer.output_dir)
    print(summary(out / "metrics.jsonl", cfg.trainer.total_steps))
    try:
        from bandpo.viz import plot_run_metrics

        print(f"  curves: {plot_run_metrics(out / 'metrics.jsonl', out / 'curves.png', title=out.name)}")
    except Exception as e:  # a plot must never turn a finished run into a failure
        print(f"  curves not written: {e}")
    return 0


def dry_run(cfg: TrainConfig) -> int:
    """Print the placement plan and its per-GPU memory by phase for the cluster this run would use;
    0 if it fits, 2 (with what is missing) if not."""
    from bandpo.distributed.memory import estimate_for, memory_errors, memory_table
    from bandpo.distributed.plan import decide_device, detect_shape, make_plan, shape_from_config, table
    from bandpo.errors import ConfigError

    shape = shape_from_config(cfg) or detect_shape(cfg.trainer.ray_address)
    try:
        plan = make_plan(cfg, shape, decide_device(cfg.trainer.device, shape.gpus_per_node))
        est = estimate_for(cfg, plan, shape)
    except ConfigError as e:
        print(f"[bandpo] dry run: the plan does not fit: {e}", file=sys.stderr)
        return 2
    print(table(plan) + "\n" + memory_table(est, plan))
    too_big = memory_errors(est)
    if too_big:
        print("[bandpo] dry run: the plan does not fit: " + "\n".join(too_big), file=sys.stderr)
        return 2
    return 0


def summary(metrics_path: Path, total_steps: int) -> str:
    """Lines for the end of a run: training reward/accuracy and held-out metrics, first vs last (with
    the change in points)."""
    from bandpo.viz import read_metrics

    rows = read_metrics(metrics_path)
    lines = [f"[bandpo] done: {total_steps} steps, outputs in {metrics_path.parent}"]
    train_rows = [r for r in rows if "reward/mean" in r]
    if train_rows:
        first, last = train_rows[0], train_rows[-1]
        for key in ("reward/mean", "reward/accuracy", "actor/entropy"):
            if key in first and key in last:
                lines.append(
                    f"  {key:<34} step {first['step']}: {first[key]:.4f} -> step {last['step']}: "
                    f"{last[key]:.4f}"
                )
    eval_rows = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if eval_rows:
        before, after = eval_rows[0], eval_rows[-1]
        keys = sorted(k for k in after if k.startswith("eval/") and ("/mean@" in k or "/maj@" in k))
        for key in keys:
            has_before = key in before and before is not after
            was = f"{before[key]:.4f}" if has_before else "  -   "
            change = f" ({100 * (after[key] - before[key]):+.1f} points)" if has_before else ""
            lines.append(
                f"  {key:<34} step {before['step']}: {was} -> step {after['step']}: {after[key]:.4f}{change}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
