"""Stage 2 of the entropy test: GRPO against BandPO (KL, delta 0.05), 3 seeds x 60 steps at stage 1's
settings, the probe entropy every 5 steps, held-out evaluations at steps 0, 30 and 60, and the verdict
by the rules the report states before the runs. Resumable, everything recorded.

    studies/entropy/stage2.sh                  # what is missing, then the report
    python -m studies.entropy.stage2 --runs DIR --pilot RUN [--records DIR] [--out REPORT]
    python -m studies.entropy.stage2 --report         # the section from the records alone

Runs go one at a time, paired by seed (GRPO, then BandPO; seed 0 first), each through scripts/train.sh
into ``<runs>/<arm>-s<seed>``. GRPO's seed 0 is stage 1's pilot (``--pilot``), continued from its step
30 to 60 with the same settings (the learning rate is constant, so 30 + 30 steps are one 60-step run).
A run keeps every 5th step's checkpoint while it trains (~2.1 GB each); when it ends, each is probed
(stage 0's probe: the same 64 held-out problems and sampling seeds for every run and step, so every
number is one measure), steps 30 and 60 are evaluated, and all checkpoints but the last are removed.

Held-out evaluations (``scripts/eval.sh``), each of two sets: the recipe's held-out one (the first 64
of tiny_arith_test, the probe's problems; the accuracy endpoint) and the training mix's kind held out
(``HELDOUT``, the 15 level-1 one-operation problems of the test split, written once to
``<runs>/heldout.jsonl``); ``sampled`` n 8 at the rollout's temperature and cap (mean@8, maj@8,
pass@8, truncation) and ``greedy`` (n 1, temperature 0). Step 0 (the base model) is evaluated and
probed once for all runs.

Records in ``<records>``: ``probe-<run>-step_N.json``, ``eval-<run>-step_N-<sampled|greedy>.json``
(``<run>`` = ``base`` at step 0), ``run-<arm>-s<seed>/`` (metrics.jsonl, config.yaml). A record is never
made again; one made with other settings stops the script, and so does a run whose folder is gone after
records were taken from it (trained again, it would be another run: ``lost``). Stage 1's probes of the
pilot (same settings, same checkpoints) are taken as they are.

The verdict's rules and the report are verdict.py's. Both holds and fails need GRPO's collapse
on every seed, so once a GRPO seed is probed at step 60 above the collapse the verdict is fixed
(inconclusive): the report says so, and a seed not begun is not started (``--all-seeds`` runs it
anyway); a begun seed's pair is finished.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from studies.entropy import stage0 as entropy_stage0
from studies.entropy import stage1 as entropy_stage1
from studies.entropy import stats as entropy_stats
from studies.entropy.design import ARMS, ENDPOINT_SET, EVALS, EVERY, HEADING, PROBED, STEPS, plan, run_name

REPO = entropy_stage0.REPO
SETTING = entropy_stage1.SETTING
# The training mix's own kind, held out: tiny_arith's test split has 15 level-1 one-operation problems
# (none in the 131 of the training split); the recipe's held-out set (the first 64 of tiny_arith_test,
# the probe's problems, 75% two-step) is evaluated beside it and is the accuracy endpoint, as the rules
# fixed before the runs say.
HELDOUT = {"name": "tiny_arith", "split": "test", "kinds": ["add", "sub", "mul"], "difficulty": 1, "size": 15}
EVAL_KINDS = {
    "sampled": ["eval.n=8", "eval.temperature=0.6", "eval.max_tokens=256"],
    "greedy": ["eval.n=1", "eval.temperature=0", "eval.max_tokens=256"],
}


def train_command(arm: str, seed: int, folder: Path, extra: list[str]) -> list[str]:
    """scripts/train.sh for one run: stage 1's settings, the arm, the seed, a checkpoint every 5 steps
    all kept, no evaluation in the run (the held-out ones run on the checkpoints afterwards)."""
    return [
        "bash", "scripts/train.sh", *SETTING, *ARMS[arm], f"trainer.seed={seed}",
        f"trainer.total_steps={STEPS}", f"trainer.save_every={EVERY}", f"trainer.keep_last={STEPS // EVERY}",
        f"trainer.output_dir={folder}", "trainer.eval_before_train=false", "trainer.eval_every=0",
        "trainer.export_hf=false", "trainer.wandb.mode=disabled", *extra,
    ]  # fmt: skip


def checkpoint(folder: Path, step: int) -> Path:
    return folder / "checkpoints" / f"step_{step:06d}"


def write_heldout(path: Path) -> Path:
    """The in-distribution held-out problems (``HELDOUT``) as JSONL (problem, answer), written once."""
    from bandpo.checkpoint.atomic import write_text_atomic
    from bandpo.data import load_source

    if not path.exists():
        rows = [json.dumps({"problem": e.problem, "answer": e.answer}) for e in load_source(HELDOUT)]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "\n".join(rows) + "\n")
    return path


def evaluate(source: str, kind: str, heldout: Path, out: Path, record: Path) -> None:
    """scripts/eval.sh on ``source`` (the base model's folder or a step folder): the recipe's held-out
    set and the in-distribution one, the results recorded."""
    from bandpo.checkpoint.atomic import write_text_atomic

    if record.exists():
        print(f"[stage2] {record.name}: recorded, skipped", flush=True)
        return
    shutil.rmtree(out, ignore_errors=True)  # an interrupted evaluation's files
    args = [f"checkpoint={source}", "cache=temp", f"eval.datasets=[{ENDPOINT_SET}]", "eval.limit=64"]
    args += [f"eval.paths={{l1_test: {heldout}}}", "eval.template=boxed", "eval.answer_format=auto"]
    args += [f"eval.out={out}", "eval.plot=false", *EVAL_KINDS[kind]]
    subprocess.run(["bash", "scripts/eval.sh", *args], cwd=REPO, check=True)
    (payload,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    write_text_atomic(record, json.dumps({"source": source, "kind": kind, **payload}, indent=1) + "\n")


def same_source(a: str, b: str) -> bool:
    """Whether two probe sources are one checkpoint: ``base`` or the same folder, however written
    (stage 1 records its run's path as given, relative to the repository or absolute)."""
    if "base" in (a, b):
        return a == b
    return (REPO / a).resolve() == (REPO / b).resolve()


def probe(stage, source: str, step: int, record: Path, earlier: Path | None = None) -> None:
    """Stage 0's probe of ``source``, recorded; ``earlier``: a stage 1 record of the same probe, reused."""
    from bandpo.checkpoint.atomic import write_text_atomic

    for path in (record, earlier):
        if path is not None and path.exists():
            done = json.loads(path.read_text())
            if done["settings"] == stage.settings and same_source(done["source"], source):
                if path != record:
                    write_text_atomic(record, path.read_text())
                print(f"[stage2] {record.name}: recorded, skipped", flush=True)
                return
            if path == record:
                raise SystemExit(f"{record}: recorded with other settings or from another checkpoint")
    done = entropy_stage1.probe_record(stage, step, source)
    write_text_atomic(record, json.dumps(done, indent=1) + "\n")
    print(f"[stage2] {record.name}: probe H {done['probe']['entropy']:.4f}", flush=True)


def stage1_lets_run(stage1_records: Path) -> tuple[bool, str]:
    """Stage 1's rule: GRPO's probe entropy at <= ``entropy_stage1.RULE`` of step 0's at a probe up to
    its last step. Returns (whether stage 2 may run, why)."""
    probes = {r["step"]: r["probe"]["entropy"] for r in entropy_stage1.load_probes(stage1_records)}
    if 0 not in probes or max(probes) < entropy_stage1.STEPS:
        return False, f"stage 1 is not complete in {stage1_records} (probes at steps {sorted(probes)})"
    low = min(h / probes[0] for s, h in probes.items() if s)
    if low > entropy_stage1.RULE:
        return False, f"stage 1's rule: GRPO's probe entropy stayed at >= {low:.0%} of its start"
    return True, f"stage 1: GRPO's probe entropy fell to {low:.0%} of its start"


def run_all(args, extra: list[str]) -> None:
    ok, why = stage1_lets_run(Path(args.stage1_records))
    if not ok:
        raise SystemExit(f"stage 2 does not run: {why}")
    print(f"[stage2] {why}", flush=True)
    runs, records = Path(args.runs).resolve(), Path(args.records)
    records.mkdir(parents=True, exist_ok=True)
    heldout = write_heldout(runs / "heldout.jsonl")
    args.batches = 0  # stage 0's rollout batches: the probe needs none
    stage = entropy_stage0.Stage0(args, [*SETTING, *extra])
    try:
        probe(stage, "base", 0, records / "probe-base-step_000000.json",
              Path(args.stage1_records) / "probe-step_000000.json")  # fmt: skip
        for kind in EVAL_KINDS:
            evaluate(stage.model_path, kind, heldout, runs / "evals" / f"base-{kind}",
                     records / f"eval-base-step_000000-{kind}.json")  # fmt: skip
        for arm, seed in plan():
            why = None if args.all_seeds else held_back(records, runs, seed)
            if why:
                print(f"[stage2] {why}; --all-seeds runs them", flush=True)
                break
            one_run(stage, arm, seed, runs, records, heldout, args, extra)
    finally:
        stage.close()


def held_back(records: Path, runs: Path, seed: int) -> str | None:
    """Why ``seed``'s runs are not started, or None: the records already fix the verdict
    (``short_of_collapse``) and no run of the seed has begun. A begun seed is finished, so that every
    recorded run has its partner of the other arm."""
    from studies.entropy import verdict as entropy_verdict

    data = entropy_verdict.collect(records)
    short = entropy_verdict.short_of_collapse(data["h0"], data["h"])
    names = [run_name(a, seed) for a in ARMS]
    if not short or any((records / f"run-{n}").is_dir() or (runs / n).is_dir() for n in names):
        return None
    s, g = short[0]
    return f"the verdict is fixed (GRPO seed {s} kept {g:.2f} of its probe entropy): seed {seed} and later not run"


def lost(name: str, folder: Path, records: Path) -> str | None:
    """Why run ``name`` must not be trained again here, or None: records were taken from it (a probe, an
    evaluation, its log) but its folder is gone. Retraining would not give it back: float rounding
    flips a sampled token within a few steps (BandPO's seed 0, retrained on another machine, parted
    from its record at step 7), so what is measured next would be another run's."""
    made = sorted(p.name for p in records.glob(f"*-{name}-step_*.json"))
    made += [f"run-{name}/"] if (records / f"run-{name}").is_dir() else []
    if not made or (folder / "metrics.jsonl").exists():
        return None
    return (
        f"{name}: {folder} is gone, but records were taken from it ({', '.join(made[:3])}"
        f"{', ...' if len(made) > 3 else ''}); training it again would record another run under its name. "
        f"Restore the folder, or remove {records}/*-{name}-step_*.json and run-{name}/ to start it over."
    )


def one_run(stage, arm, seed, runs: Path, records: Path, heldout: Path, args, extra) -> None:
    name = run_name(arm, seed)
    folder = Path(args.pilot).resolve() if (arm, seed) == ("grpo", 0) else runs / name
    probes = {s: records / f"probe-{name}-step_{s:06d}.json" for s in PROBED}
    evals = {(s, k): records / f"eval-{name}-step_{s:06d}-{k}.json" for s in EVALS for k in EVAL_KINDS}
    if all(p.exists() for p in [*probes.values(), *evals.values()]):
        print(f"[stage2] {name}: recorded, skipped", flush=True)
        return
    if not checkpoint(folder, STEPS).is_dir():
        if why := lost(name, folder, records):
            raise SystemExit(why)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "train.log", "a") as log:
            subprocess.run(train_command(arm, seed, folder, extra), cwd=REPO, check=True, stdout=log,
                           stderr=subprocess.STDOUT)  # fmt: skip
    kept = records / f"run-{name}"
    kept.mkdir(exist_ok=True)
    for f in ("metrics.jsonl", "config.yaml"):
        shutil.copy(folder / f, kept / f)
    stage1 = Path(args.stage1_records)
    for s, path in probes.items():
        if not checkpoint(folder, s).is_dir() and not path.exists():
            raise SystemExit(f"{checkpoint(folder, s)}: no checkpoint to probe (removed before its probe?)")
        earlier = stage1 / f"probe-step_{s:06d}.json" if (arm, seed) == ("grpo", 0) else None
        probe(stage, str(checkpoint(folder, s)), s, path, earlier)
    for (s, kind), path in evals.items():
        evaluate(str(checkpoint(folder, s)), kind, heldout, runs / "evals" / f"{name}-{s}-{kind}", path)
    for s in PROBED:  # all recorded: only the last checkpoint is kept
        if s != STEPS and checkpoint(folder, s).is_dir():
            shutil.rmtree(checkpoint(folder, s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after the stage's own (stage 1's SETTING)")
    ap.add_argument("--runs", default="runs/entropy_stage2", help="the runs' folders, the held-out file")
    ap.add_argument("--pilot", default="runs/entropy_stage1/grpo", help="stage 1's run: GRPO's seed 0")
    ap.add_argument("--stage1-records", default="studies/entropy/records/stage1")
    ap.add_argument("--records", default="studies/entropy/records/stage2")
    ap.add_argument("--out", default="studies/entropy/results-entropy.md")
    ap.add_argument("--probe-prompts", type=int, default=64, help="held-out problems (stage 0's probe)")
    ap.add_argument("--probe-samples", type=int, default=1, help="samples of each probe problem")
    ap.add_argument("--report", action="store_true", help="only write the section from the records")
    ap.add_argument("--all-seeds", action="store_true",
                    help="run every seed even when the records already fix the verdict (by default a seed not "
                         "begun is not started then)")  # fmt: skip
    args = ap.parse_args()
    if not args.report:
        run_all(args, list(args.overrides))
    from studies.entropy import figure as entropy_figure  # draws with matplotlib: only here
    from studies.entropy import verdict as entropy_verdict

    out, records = Path(args.out), Path(args.records)
    runs = entropy_figure.series(records)
    png = entropy_figure.draw(runs, out.with_name(out.stem + "-headline.png")) if runs else None
    section = entropy_verdict.report(records, png.name if png else None)
    print(entropy_stats.write_section(out, section, HEADING))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
