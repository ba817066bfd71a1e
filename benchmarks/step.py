"""Benchmark: where one training step's time goes, and end-to-end tokens/s, for a real run.

Runs ``scripts/train.sh`` as a subprocess (the tiny recipe on CPU by default) with
``trainer.total_steps=--steps`` and evaluation, HF export, checkpoints and wandb off, then
reads the ``time/<stage>`` metrics the trainer logs per step in ``metrics.jsonl``. Step 1
is dropped as warm-up when there is more than one step. Printed (and written as JSON):

- per stage (sample, rollout, reward, advantages, logprobs, update, weight_sync, ...):
  median and mean seconds over the measured steps, and its share of their total step time
  ("other" is the step time no stage accounts for: metrics, batching, logging);
- generated tokens/s (over whole steps) and rollout tokens/s (over the rollout stage);
- wall time of the whole command, including start-up (model build when not cached, Ray,
  vLLM, DeepSpeed) and shutdown, and the tokens/s that wall time gives;
- the trainer's start-up phases (``<run>/startup.json``: model, ray, verifier — which
  overlaps the engines' and actor's loading —, the waits left for rollout and actor, setup
  in all, and the process's time before setup: imports, config).

    .venv/bin/python -m benchmarks.step [--steps 4] [--model-path DIR] [--output-dir DIR] \\
        [--out bench_step.json] [--compare-staleness] [-- HYDRA_OVERRIDES...]

``--compare-staleness`` runs the config twice, back to back, with ``trainer.max_staleness`` 0
and 1 (the load average is printed before and after each), and prints the per-stage medians
side by side, each side's busy and idle seconds per step (rollout: sample + rollout + reward;
actor: logprobs + update), the seconds both were busy at once (``time/overlap``), steps/s and
their ratio (``overlap_summary``). The CPU analogue of the split GPU layout gives each side its
own core in both runs: ``-- rollout.cpu_threads=1 actor.cpu_threads=1``.

Overrides after ``--`` go to train.sh after ours, so they win (e.g. ``algorithm=grpo
rollout.n=8``). ``trainer.save_every=K`` there turns checkpoints on, but their time is
not reported: the trainer saves after the step's metrics line is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bandpo.viz import read_metrics

REPO = Path(__file__).resolve().parents[1]

# The trainer's stages in the order they run; any other time/<name> key is listed after them.
STAGE_ORDER = (
    "sample",
    "rollout",
    "reward",
    "advantages",
    "logprobs",
    "update",
    "overlap_wait",
    "weight_sync",
    "checkpoint",
    "eval",
)
# Spans, not stages of their own: dynamic sampling's rounds hold sample/rollout/reward; with
# trainer.max_staleness=1 the background stage holds them too (overlap_wait is its tail, the
# driver waiting for it), and overlap is the time it shared with logprobs/update. "other" is the
# step time the stages leave, counting shared time once.
SPANS = ("dynamic_sampling", "background", "overlap", "overlap_wait")
ROLLOUT_SIDE = ("sample", "rollout", "reward")  # the engines and the verifier
ACTOR_SIDE = ("logprobs", "update")


def train_overrides(steps: int, output_dir: Path, model_path: Path | None, extra: list[str]) -> list[str]:
    """The Hydra overrides of the benchmark run: ours first, then ``extra`` (which win)."""
    ours = [
        f"trainer.total_steps={steps}",
        "trainer.eval_before_train=false",
        "trainer.eval_every=0",
        "trainer.export_hf=false",
        "trainer.save_every=0",
        "trainer.resume=never",
        "trainer.wandb.mode=disabled",
        f"trainer.output_dir={output_dir}",
    ]
    if model_path is not None:
        ours += [f"model.path={model_path}", "model.build=null"]
    return ours + extra


def run_training(overrides: list[str], log_path: Path) -> float:
    """Run scripts/train.sh with ``overrides``, its output to ``log_path``; returns wall seconds.

    Raises RuntimeError with the log's tail when the run fails.
    """
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            ["bash", str(REPO / "scripts" / "train.sh"), *overrides],
            cwd=REPO,
            check=False,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"scripts/train.sh exited with {proc.returncode} (full log: {log_path}):\n{tail}")
    return wall


def summarize(rows: list[dict], wall_s: float) -> dict:
    """Stage times and throughput from the training rows of a metrics file (see the module docstring).

    Args:
        rows: metrics.jsonl rows; those without ``time/step`` (evaluation lines) are ignored.
        wall_s: wall seconds of the whole training command.

    Returns:
        A JSON-ready dict: ``stages`` ({name: median_s, mean_s, share}), ``step``,
        ``throughput``, the step numbers measured and the warm-up step's time.
    """
    steps = [r for r in rows if isinstance(r.get("time/step"), (int, float))]
    if not steps:
        raise ValueError("metrics.jsonl has no training step (no 'time/step' key)")
    warmup = steps[0] if len(steps) > 1 else None
    measured = steps[1:] if warmup else steps
    names = sorted(
        {k[5:] for r in measured for k in r if k.startswith("time/") and k != "time/step"},
        key=lambda s: (STAGE_ORDER.index(s) if s in STAGE_ORDER else len(STAGE_ORDER), s),
    )
    step_times = [r["time/step"] for r in measured]
    total = sum(step_times)
    stages = {}
    for name in names:
        # A stage missing from a step (a skipped update) took no time in that step.
        times = [float(r.get(f"time/{name}", 0.0)) for r in measured]
        stages[name] = _stats(times, total)
    stages["other"] = _stats(
        [
            r["time/step"]
            - sum(float(r.get(f"time/{n}", 0.0)) for n in names if n not in SPANS)
            + float(r.get("time/overlap", 0.0))
            for r in measured
        ],
        total,
    )
    # The trainer logs perf/tokens_per_s = generated tokens / step time, so this recovers the tokens.
    gen_tokens = [r["perf/tokens_per_s"] * r["time/step"] for r in measured]
    all_tokens = sum(r["perf/tokens_per_s"] * r["time/step"] for r in steps)
    rollout_s = sum(float(r.get("time/rollout", 0.0)) for r in measured)
    return {
        "steps_measured": [r["step"] for r in measured],
        "warmup_step_s": warmup["time/step"] if warmup else None,
        "stages": stages,
        "step": _stats(step_times, total),
        "throughput": {
            "generated_tokens_per_step": statistics.mean(gen_tokens),
            "tokens_per_s": sum(gen_tokens) / total,
            "rollout_tokens_per_s": sum(gen_tokens) / rollout_s if rollout_s > 0 else None,
            "wall_s": wall_s,
            "outside_steps_s": wall_s - sum(r["time/step"] for r in steps),
            "wall_tokens_per_s": all_tokens / wall_s,
        },
    }


def _stats(times: list[float], total: float) -> dict:
    return {
        "median_s": statistics.median(times),
        "mean_s": statistics.mean(times),
        "share": sum(times) / total if total > 0 else 0.0,
    }


def run_config(output_dir: Path) -> dict:
    """The batch shape of the run, from the config.yaml the trainer wrote."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(output_dir / "config.yaml")
    return {
        "model": str(cfg.model.path),
        "algorithm": cfg.algorithm.name,
        "device": cfg.trainer.device,
        "prompts_per_step": cfg.trainer.prompts_per_step,
        "n": cfg.rollout.n,
        "max_tokens": cfg.rollout.max_tokens,
        "rollout_workers": cfg.rollout.num_workers,
        "actor_workers": cfg.actor.num_workers,
    }


def print_report(report: dict) -> None:
    c, s = report["config"], report["summary"]
    t = s["throughput"]
    print(
        f"\nmodel: {c['model']}  algorithm: {c['algorithm']}  device: {c['device']}  "
        f"batch: {c['prompts_per_step']} prompts x n={c['n']}, max_tokens {c['max_tokens']}  "
        f"CPUs: {report['machine']['cpus']}, load average {report['machine']['load_average_1m']:.1f}"
    )
    warm = s["warmup_step_s"]
    print(
        f"steps measured: {s['steps_measured']}"
        + (f" (step 1 = warm-up, {warm:.2f} s, dropped)" if warm else "")
    )
    print("\n| stage | median s | mean s | share of step |\n|---|---|---|---|")
    for name, st in s["stages"].items():
        print(f"| {name} | {st['median_s']:.3f} | {st['mean_s']:.3f} | {100 * st['share']:.1f}% |")
    st = s["step"]
    print(f"| **step** | {st['median_s']:.3f} | {st['mean_s']:.3f} | 100% |")
    rollout = t["rollout_tokens_per_s"]
    print("\n| throughput | value |\n|---|---|")
    print(f"| generated tokens per step | {t['generated_tokens_per_step']:.0f} |")
    print(f"| generated tokens/s (whole steps) | {t['tokens_per_s']:.1f} |")
    print(
        f"| rollout tokens/s (rollout stage) | {rollout:.1f} |" if rollout else "| rollout tokens/s | n/a |"
    )
    print(f"| wall time incl. start-up, s | {t['wall_s']:.1f} |")
    print(f"| of which outside steps (start-up, shutdown), s | {t['outside_steps_s']:.1f} |")
    print(f"| tokens/s over wall time (all steps) | {t['wall_tokens_per_s']:.1f} |")
    if report.get("startup"):
        print("\n| start-up phase | s |\n|---|---|")
        for name, seconds in report["startup"].items():
            print(f"| {name} | {seconds:.1f} |")


def overlap_summary(rows: list[dict]) -> dict:
    """Steps/s over every step (step 1 and the last included: an overlapped run draws two batches in
    its first step and none in its last), and per step of the steady state (steps 2 .. K-1, all when
    K < 3) the busy and idle seconds of each side (rollout: sample + rollout + reward; actor:
    logprobs + update) and the seconds both were busy at once (``time/overlap``)."""
    steps = [r for r in rows if isinstance(r.get("time/step"), (int, float))]
    total = sum(r["time/step"] for r in steps)
    steady = steps[1:-1] or steps

    def busy(r, names):
        return sum(float(r.get(f"time/{n}", 0.0)) for n in names)

    def mean(f):
        return statistics.mean(f(r) for r in steady)

    return {
        "steps": len(steps),
        "steps_per_s": len(steps) / total,
        "steady_steps": [r["step"] for r in steady],
        "steady_step_s": mean(lambda r: r["time/step"]),
        "rollout_busy_s": mean(lambda r: busy(r, ROLLOUT_SIDE)),
        "actor_busy_s": mean(lambda r: busy(r, ACTOR_SIDE)),
        "rollout_idle_s": mean(lambda r: r["time/step"] - busy(r, ROLLOUT_SIDE)),
        "actor_idle_s": mean(lambda r: r["time/step"] - busy(r, ACTOR_SIDE)),
        "overlap_s": mean(lambda r: float(r.get("time/overlap", 0.0))),
    }


def compare_staleness(steps: int, out_dir: Path, model_path: Path | None, extra: list[str]) -> dict:
    """The same config with trainer.max_staleness 0, then 1, back to back (each in ``out_dir/max_staleness_<s>``)."""
    runs = {}
    for staleness in (0, 1):
        run_dir = out_dir / f"max_staleness_{staleness}"
        run_dir.mkdir(parents=True, exist_ok=True)
        overrides = train_overrides(
            steps, run_dir, model_path, [*extra, f"trainer.max_staleness={staleness}"]
        )
        print(f"running: scripts/train.sh {' '.join(overrides)}\nlog: {run_dir / 'train.log'}", flush=True)
        load_before = os.getloadavg()[0]
        wall = run_training(overrides, run_dir / "train.log")
        rows = read_metrics(run_dir / "metrics.jsonl")
        runs[staleness] = {
            "command": ["scripts/train.sh", *overrides],
            "load_average_1m_before": load_before,
            "load_average_1m_after": os.getloadavg()[0],
            "summary": summarize(rows, wall),
            "overlap": overlap_summary(rows),
        }
    sync, stale = runs[0]["overlap"], runs[1]["overlap"]
    return {
        "config": run_config(out_dir / "max_staleness_0"),
        "machine": {"cpus": os.cpu_count()},
        "runs": {f"max_staleness_{k}": v for k, v in runs.items()},
        "ratio": {
            "steps_per_s": stale["steps_per_s"] / sync["steps_per_s"],
            "steady_step": sync["steady_step_s"] / stale["steady_step_s"],
        },
    }


def print_comparison(report: dict) -> None:
    c, runs = report["config"], report["runs"]
    s0, s1 = runs["max_staleness_0"], runs["max_staleness_1"]
    print(
        f"\nmodel: {c['model']}  algorithm: {c['algorithm']}  device: {c['device']}  batch: {c['prompts_per_step']} "
        f"prompts x n={c['n']}, max_tokens {c['max_tokens']}  CPUs: {report['machine']['cpus']}"
    )
    print(
        "load average (1 min) before / after: "
        + ", ".join(
            f"max_staleness {k[-1]}: {r['load_average_1m_before']:.1f} / {r['load_average_1m_after']:.1f}"
            for k, r in runs.items()
        )
    )
    names = list(dict.fromkeys([*s0["summary"]["stages"], *s1["summary"]["stages"]]))
    print("\n| stage (median s, steps 2..K) | max_staleness 0 | max_staleness 1 |\n|---|---|---|")
    for name in names:
        cells = [
            f"{r['summary']['stages'][name]['median_s']:.3f}" if name in r["summary"]["stages"] else "-"
            for r in (s0, s1)
        ]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    o0, o1 = s0["overlap"], s1["overlap"]
    print(
        f"\n| per step (mean over steady steps {o1['steady_steps']}) | max_staleness 0 | max_staleness 1 |"
        "\n|---|---|---|"
    )
    for key, label in (
        ("steady_step_s", "step s"),
        ("rollout_busy_s", "rollout side busy s"),
        ("rollout_idle_s", "rollout side idle s"),
        ("actor_busy_s", "actor side busy s"),
        ("actor_idle_s", "actor side idle s"),
        ("overlap_s", "overlap (both busy) s"),
    ):
        print(f"| {label} | {o0[key]:.3f} | {o1[key]:.3f} |")
    print(f"| steps/s over all {o0['steps']} steps | {o0['steps_per_s']:.4f} | {o1['steps_per_s']:.4f} |")
    r = report["ratio"]
    print(
        f"\nratio max_staleness 1 / 0: steps/s (all steps) {r['steps_per_s']:.3f}x, "
        f"steady-state step {r['steady_step']:.3f}x"
    )


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="%(prog)s [options] [-- HYDRA_OVERRIDES...]"
    )
    ap.add_argument(
        "--steps", type=int, default=4, help="training steps; step 1 is dropped as warm-up if > 1"
    )
    ap.add_argument("--model-path", type=Path, help="an existing HF model folder (sets model.build=null)")
    ap.add_argument(
        "--output-dir",
        type=Path,
        help="run folder to create (kept); default: a temporary one, removed after success",
    )
    ap.add_argument("--out", default="bench_step.json", help="JSON results file")
    ap.add_argument(
        "--compare-staleness",
        action="store_true",
        help="run trainer.max_staleness 0 then 1 back to back and compare steps/s, overlap and idle time",
    )
    args = ap.parse_args(ours)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if any(o.startswith("trainer.output_dir=") for o in extra):
        ap.error("set the run folder with --output-dir, not trainer.output_dir=")
    if args.model_path is not None and not (args.model_path / "config.json").is_file():
        ap.error(f"--model-path {args.model_path} has no config.json (not a Hugging Face model folder)")
    temporary = args.output_dir is None
    out_dir = Path(tempfile.mkdtemp(prefix="bandpo-bench-step-")) if temporary else args.output_dir.resolve()
    if (out_dir / "metrics.jsonl").exists():
        ap.error(f"{out_dir} already holds a run (metrics.jsonl); choose a new --output-dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = args.model_path.resolve() if args.model_path else None

    if args.compare_staleness:
        report = compare_staleness(args.steps, out_dir, model_path, extra)
        print_comparison(report)
    else:
        overrides = train_overrides(args.steps, out_dir, model_path, extra)
        print(f"running: scripts/train.sh {' '.join(overrides)}\nlog: {out_dir / 'train.log'}", flush=True)
        wall = run_training(overrides, out_dir / "train.log")
        startup = out_dir / "startup.json"
        report = {
            "command": ["scripts/train.sh", *overrides],
            "config": run_config(out_dir),
            "machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
            "summary": summarize(read_metrics(out_dir / "metrics.jsonl"), wall),
            # Seconds per start-up phase as the trainer timed them (bandpo.trainer.loop._report_startup).
            "startup": json.loads(startup.read_text()) if startup.exists() else {},
        }
        print_report(report)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    if temporary:
        shutil.rmtree(out_dir)
    return report


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:  # a failed training run: its log's tail is the message
        sys.exit(f"bench_step: {e}")
