"""Runs the claim test's runs one at a time and keeps each run's small records, which are what the report
reads (``protocol.md``: nothing depends on a checkpoint outliving the machine).

    python -m studies.claim.run random                      # every primary run not yet recorded, seed by seed
    python -m studies.claim.run random --arms grpo,bandpo --seeds 0
    python -m studies.claim.run random --secondary --seeds 0,1,2
    python -m studies.claim.run random --dry-run             # the commands, nothing started

Each run goes through ``scripts/train.sh`` into ``<runs>/<test>/<arm>-s<seed>`` (resumable there: the trainer
resumes from its last checkpoint). When it ends, ``records/<test>/<arm>-s<seed>/`` gets its
``metrics.jsonl`` and ``config.yaml``, and ``run.json``: the overrides, the machine (CPU name and whether it
multiplies bf16 in hardware, which with the resolved ``actor.bf16`` decides whether two arms are a pair),
the commit it started from, the wall time and the probe texts' sha256. The texts themselves (every run of one base model
samples the same ones: ``probe.seed`` is fixed) are kept once per test, in
``records/<test>/probe-texts.jsonl``; a run whose texts differ from those stops the script. A test with a
held-out set of its own (``design.HeldOut``) has it written to ``<runs>/<test>/<name>.jsonl`` before its
first run, and each ``run.json`` keeps the file's sha256. A recorded run is never run again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from studies.claim.design import HeldOut, overrides, plan, run_name, test

REPO = Path(__file__).resolve().parents[2]
RECORDS = Path(__file__).resolve().parent / "records"
KEPT = ("metrics.jsonl", "config.yaml")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def machine() -> dict:
    from bandpo.distributed.precision import cpu_has_fast_bf16, cpu_name

    return {"cpu": cpu_name(), "fast_bf16": cpu_has_fast_bf16(), "cores": os.cpu_count()}


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "bandpo", "configs"], cwd=REPO, capture_output=True, text=True
    )
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_heldout(heldout: HeldOut, runs_test: Path) -> Path:
    """The test's held-out set as JSONL in ``runs_test`` (the same rows every time: the generator is seeded)."""
    from bandpo.data.tiny_arith_problems import write_jsonl

    return write_jsonl(runs_test / f"{heldout.name}.jsonl", heldout.rows())


def keep(folder: Path, dest: Path, record: dict) -> None:
    """Copies the run's small records into ``dest`` and writes ``run.json`` last (its presence marks the run
    recorded); the probe texts are checked against the test's kept copy (beside ``dest``), or become it."""
    from bandpo.checkpoint.atomic import write_text_atomic

    texts = folder / "probe" / "texts.jsonl"
    if not texts.exists():
        raise SystemExit(f"{folder}: no probe/texts.jsonl; was the run started with probe.every > 0?")
    kept_texts = dest.parent / "probe-texts.jsonl"
    dest.parent.mkdir(parents=True, exist_ok=True)  # the first run of a fresh records folder makes it
    if kept_texts.exists() and sha256(kept_texts) != sha256(texts):
        raise SystemExit(f"{texts} differs from {kept_texts}: another base model or probe settings")
    if not kept_texts.exists():
        write_text_atomic(kept_texts, texts.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        write_text_atomic(dest / name, (folder / name).read_text())
    record["probe_texts_sha256"] = sha256(texts)
    write_text_atomic(dest / "run.json", json.dumps(record, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test", help="random | learn")
    ap.add_argument("--arms", help="comma-separated arms (default: the test's primary arms)")
    ap.add_argument("--secondary", action="store_true", help="the test's secondary arms")
    ap.add_argument("--seeds", help="comma-separated seeds (default: the test's)")
    ap.add_argument("--runs", default="runs/claim", help="where the runs train (checkpoints, logs)")
    ap.add_argument("--records", default=str(RECORDS))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("extra", nargs="*", help="Hydra overrides after the design's (recorded in run.json)")
    args = ap.parse_args()
    t = test(args.test)
    arms = tuple(args.arms.split(",")) if args.arms else (t.secondary if args.secondary else t.arms)
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None
    records = Path(args.records)
    heldout = None
    if t.heldout is not None:
        runs_test = Path(args.runs) / t.name
        heldout = write_heldout(t.heldout, runs_test if runs_test.is_absolute() else REPO / runs_test)
    for arm, seed in plan(t, arms, seeds):
        name = run_name(arm, seed)
        dest, folder = records / t.name / name, Path(args.runs) / t.name / name
        if (dest / "run.json").exists():
            print(f"{t.name}/{name}: recorded, skipped")
            continue
        ov = [*overrides(t, arm, seed, heldout and str(heldout)), *args.extra, f"trainer.output_dir={folder}"]
        cmd = ["bash", "scripts/train.sh", *ov]
        print(f"{t.name}/{name}: {' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        started, t0, code = time.time(), time.perf_counter(), commit()  # the code the run starts with
        done = subprocess.run(cmd, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"{t.name}/{name}: scripts/train.sh exited {done.returncode}; see {folder}/logs")
        record = {
            "test": t.name, "arm": arm, "seed": seed, "overrides": ov, "extra": args.extra,
            "machine": machine(), "commit": code, "started": started,
            "wall_s": round(time.perf_counter() - t0, 1), "load_after": os.getloadavg(),
        }  # fmt: skip
        if heldout is not None:
            record["heldout_sha256"] = sha256(heldout)
        keep(REPO / folder if not folder.is_absolute() else folder, dest, record)
        print(f"{t.name}/{name}: recorded in {dest} ({record['wall_s']:.0f} s)", flush=True)
        if (folder / "checkpoints").exists():
            shutil.rmtree(folder / "checkpoints")


if __name__ == "__main__":
    main()
