"""Benchmark: the README's first command as a newcomer runs it, and where its time goes.

Runs ``scripts/train.sh`` (the tiny BandPO default; the venv must exist) with an empty model cache
(``BANDPO_CACHE`` set to a new folder, so the tiny model is built) or, with ``--cache DIR``, the cache
in DIR (a second seed reusing a build), and times the whole command. Then reads what the run wrote
and prints one table (and JSON) of its parts:

- before setup: interpreter start, imports and config (``startup.json``'s ``process``);
- the model: the tiny build's seconds and warm-start steps (its cache marker's report);
- start-up after the build: Ray, the verifier pool, and the waits left for the engines and the actor
  ranks (which load at the same time as the verifier);
- the training steps (sum of ``time/step``), with the rollout's and the update's shares;
- the held-out evaluations (sum of ``time/eval``) and the held-out mean@32 before and after;
- what is left: shutdown, the HF export, the final summary and figure.

The CPU's name, whether it multiplies bf16 in hardware, and the load average before and after are
printed with it: timings on shared cores are not comparable.

``--emulate-avx2`` runs it as on a CPU without AVX-512: torch, oneDNN and MKL held to AVX2
(``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``), vLLM's AVX2 kernels
(``benchmarks/avx2/sitecustomize.py``) and fp32 (``actor.bf16=false``, what ``auto`` picks there).
The clock, caches and cores stay this machine's: it estimates the kernels' share of the difference,
and is no substitute for the machine.

    .venv/bin/python -m benchmarks.first_command [--seed 0] [--cache DIR] [--out first_command.json] \\
        [--emulate-avx2] [-- HYDRA_OVERRIDES...]
    .venv/bin/python -m benchmarks.first_command --report RUN_DIR [--wall SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _build_report(model_path: str) -> dict:
    from bandpo.models.tiny_arith import MARKER

    marker = Path(model_path) / MARKER
    return json.loads(marker.read_text()).get("report", {}) if marker.exists() else {}


def parts(run: Path, wall: float | None) -> dict:
    """The first command's parts from its run folder (``wall``: the whole command's seconds, if timed)."""
    from bandpo.distributed.precision import cpu_has_fast_bf16, cpu_name
    from bandpo.viz import read_metrics

    startup = json.loads((run / "startup.json").read_text())
    rows = read_metrics(run / "metrics.jsonl")
    steps = [r for r in rows if "time/step" in r]
    evals = [r for r in rows if "time/eval" in r]
    config = yaml.safe_load((run / "config.yaml").read_text())
    build = _build_report(config["model"]["path"])
    mean32 = [r[k] for r in evals for k in r if k.endswith("/mean@32")]
    out = {
        "cpu": cpu_name(),
        "fast_bf16": cpu_has_fast_bf16(),
        "before_setup_s": round(startup.get("process", 0.0), 1),
        "model_s": round(startup.get("model", 0.0), 1),
        "build_steps": build.get("sft_steps_taken"),
        "build_warm_start_s": build.get("sft_seconds"),
        "startup_after_model_s": round(startup["setup"] - startup.get("model", 0.0), 1),
        "startup_phases_s": {k: round(v, 1) for k, v in startup.items() if k not in ("setup", "process")},
        "steps": len(steps),
        "steps_s": round(sum(r["time/step"] for r in steps), 1),
        "rollout_s": round(sum(r.get("time/rollout", 0.0) for r in steps), 1),
        "update_s": round(sum(r.get("time/update", 0.0) for r in steps), 1),
        "dynamic_sampling_rounds": sum(r.get("filter/rounds", 0) for r in steps),
        "evals": len(evals),
        "evals_s": round(sum(r["time/eval"] for r in evals), 1),
        "held_out_mean32_first_last": [mean32[0], mean32[-1]] if mean32 else None,
        "held_out_gain_points": round(100 * (mean32[-1] - mean32[0]), 1) if len(mean32) > 1 else None,
    }
    if wall is not None:
        accounted = startup["setup"] + startup.get("process", 0.0) + out["steps_s"] + out["evals_s"]
        out.update(wall_s=round(wall, 1), other_s=round(wall - accounted, 1))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", help="the model cache to use (default: a new, empty folder)")
    parser.add_argument("--output-dir", help="the run folder (default: a new temporary folder)")
    parser.add_argument("--out", default="first_command.json")
    parser.add_argument(
        "--emulate-avx2", action="store_true", help="AVX2 kernels and fp32 (module docstring)"
    )
    parser.add_argument("--report", help="report an existing run folder instead of running")
    parser.add_argument("--wall", type=float, help="with --report: the command's wall seconds")
    parser.add_argument("overrides", nargs="*")
    ns = parser.parse_args(argv)
    if ns.report:
        result = parts(Path(ns.report), ns.wall)
    else:
        cache = ns.cache or tempfile.mkdtemp(prefix="bandpo-cache-")
        empty = not any(Path(cache).iterdir()) if Path(cache).is_dir() else True
        run = Path(ns.output_dir or tempfile.mkdtemp(prefix="bandpo-first-")) / f"s{ns.seed}"
        load_before = os.getloadavg()
        env = dict(os.environ, BANDPO_CACHE=cache)
        cmd = ["bash", "scripts/train.sh", f"trainer.seed={ns.seed}", f"trainer.output_dir={run}"]
        if ns.emulate_avx2:
            site = str(ROOT / "benchmarks" / "avx2")
            env.update(
                BANDPO_EMULATE_AVX2="1",
                ATEN_CPU_CAPABILITY="avx2",
                ONEDNN_MAX_CPU_ISA="AVX2",
                MKL_ENABLE_INSTRUCTIONS="AVX2",
                PYTHONPATH=os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p),
            )
            cmd.append("actor.bf16=false")  # what actor.bf16=auto picks on a CPU without avx512_bf16
        cmd += ns.overrides
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        wall = time.perf_counter() - t0
        result = parts(run, wall)
        result.update(
            cache=cache,
            empty_cache=empty,
            emulated_avx2=ns.emulate_avx2,
            load_before=[round(x, 2) for x in load_before],
            load_after=[round(x, 2) for x in os.getloadavg()],
        )
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
    Path(ns.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
