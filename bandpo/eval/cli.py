"""The ``python -m bandpo.eval`` / ``scripts/eval.sh`` command: one model, or every kept step of a run.

With several steps (``steps=all``) one engine is started for the first step and later steps
only reload weights into it (engine start-up dominates on CPU). Per step the usual
``eval_<template>_n<n>.{json,md,png}`` go to ``runs/<name>/eval/step_N/``; the run gets
``runs/<name>/eval_steps_<template>_n<n>.{json,md,png}``: a table and mean@n, pass@k, maj@n
against training step per dataset, next to ``metrics.jsonl``. User mistakes exit 2 with one line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bandpo.errors import EvalUsageError, InputError
from bandpo.eval.targets import CACHE_CHOICES, Target, materialize, model_dtype, resolve_targets

if TYPE_CHECKING:
    from bandpo.eval.evaluate import EvalCLIConfig

log = logging.getLogger("bandpo.eval.evaluate")


def prepare(argv: Sequence[str]):
    """Config, targets and datasets: everything that can be a user mistake, before any engine starts."""
    from omegaconf.errors import OmegaConfBaseException

    from bandpo.data.datasets import load_eval_sets
    from bandpo.eval.evaluate import EvalCLIConfig, load_cli_config

    try:
        cfg = load_cli_config(argv)
    except OmegaConfBaseException as e:
        valid = ", ".join(f.name for f in EvalCLIConfig.__dataclass_fields__.values())
        raise EvalUsageError(
            f"bad override: {str(e).splitlines()[0]} (top-level keys: {valid}; "
            f"eval.* keys: see bandpo/eval/evaluate.py EvalConfig)"
        ) from None
    if cfg.cache not in CACHE_CHOICES:
        raise EvalUsageError(f"cache={cfg.cache!r}: expected one of {list(CACHE_CHOICES)}")
    targets = resolve_targets(cfg.checkpoint, cfg.step, cfg.steps)
    datasets = load_eval_sets(cfg.eval.datasets, cfg.eval.paths, limit=cfg.eval.limit)
    return cfg, targets, datasets


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry: evaluate, print the table(s), write outputs. Returns the JSON payload (per step: a list)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # vLLM logs to stdout by default; keep stdout for the table (read before vLLM is imported).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, targets, datasets = prepare(argv)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as e:
        _usage_exit(e)
    with tempfile.TemporaryDirectory(prefix="bandpo-eval-") as tmp:
        try:
            return _run(cfg, targets, datasets, Path(tmp))
        except (EvalUsageError, InputError) as e:  # found before the engine starts: the model, its tokenizer
            _usage_exit(e)


def _usage_exit(e: BaseException):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"eval: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _run(cfg: EvalCLIConfig, targets: list[Target], datasets, tmp: Path) -> dict:
    from bandpo.data.prompts import answer_format_for
    from bandpo.eval.evaluate import evaluate_config
    from bandpo.hub import load_tokenizer
    from bandpo.reward import RewardScorer
    from bandpo.rollout import make_engine

    ev = cfg.eval
    answer_format = answer_format_for(ev.template, ev.answer_format)
    scorer = RewardScorer(
        answer_format=answer_format, num_workers=ev.verifier_workers, timeout=ev.verifier_timeout
    )
    engine, payloads = None, []
    try:
        for i, target in enumerate(targets):
            model_path = materialize(target, base_model=cfg.base_model, cache=cfg.cache, temp_root=tmp)
            if engine is None:
                tokenizer = load_tokenizer(
                    cfg.tokenizer or model_path, "tokenizer" if cfg.tokenizer else "checkpoint"
                )
                engine = make_engine(ev.backend, model_path, **engine_kwargs(ev.engine, model_path))
            else:  # same architecture, new weights: reload instead of restarting the engine
                engine.update_weights(_read_weights(model_path))
            log.info("evaluating %s (%d/%d)", target.label, i + 1, len(targets))
            results = evaluate_config(engine, scorer, tokenizer, datasets, ev, keep_samples=ev.save_samples)
            payloads.append(_write_one(cfg, target, model_path, answer_format, results, len(targets) > 1))
    finally:
        if engine is not None:
            engine.shutdown()
        scorer.close()
    if len(targets) == 1:
        return payloads[0]
    return _write_steps(cfg, targets, payloads)


def engine_kwargs(engine: Mapping[str, Any], model_path: str) -> dict[str, Any]:
    """``make_engine``'s kwargs: ``eval.engine``, with the checkpoint's dtype unless it names one (vLLM's own
    ``auto`` would turn a float32 model into bf16: ``bandpo.eval.targets.model_dtype``)."""
    kw = dict(engine)
    if "dtype" not in kw:
        kw["dtype"] = model_dtype(model_path)
    return kw


def _read_weights(model_path: str):
    from safetensors.torch import load_file

    for file in sorted(Path(model_path).glob("*.safetensors")):
        yield from load_file(str(file)).items()


def _stem(ev) -> str:
    from bandpo.data.prompts import TEMPLATES

    return f"eval_{ev.template if ev.template in TEMPLATES else 'custom'}_n{ev.n}"


def _out_dir(cfg: EvalCLIConfig, target: Target, per_step_sub: bool) -> Path:
    from bandpo.eval.evaluate import default_out_dir

    if cfg.eval.out:
        base = Path(cfg.eval.out)
        return base / f"step_{target.step:06d}" if per_step_sub and target.step is not None else base
    if target.run_dir is not None and target.step is not None:
        return target.run_dir / "eval" / f"step_{target.step:06d}"
    return default_out_dir(cfg.checkpoint)


def _write_one(
    cfg: EvalCLIConfig, target: Target, model_path: str, answer_format: str, results: dict, many: bool
) -> dict:
    from bandpo.eval.evaluate import markdown_table

    ev = cfg.eval
    samples = {name: s.pop("samples") for name, s in results.items() if "samples" in s}
    table = markdown_table(results)
    print((f"\n## step {target.step}\n" if many else "") + table, flush=True)
    out_dir = _out_dir(cfg, target, many)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = _stem(ev)
    payload = {
        "checkpoint": cfg.checkpoint,
        "step": target.step,
        "model_path": model_path,
        "answer_format": answer_format,
        "config": asdict(ev),
        "results": results,
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(table + "\n")
    if ev.plot:
        from bandpo.viz import plot_pass_at_k

        plot_pass_at_k(results, out_dir / f"{stem}.png", title=f"pass@k: {target.label}")
    if samples:
        with open(out_dir / f"{stem}_samples.jsonl", "w") as f:
            for name, records in samples.items():
                f.writelines(json.dumps({"dataset": name, **rec}) + "\n" for rec in records)
    log.info("wrote %s/%s.*", out_dir, stem)
    return payload


def steps_table(rows: Sequence[tuple[int, Mapping[str, Mapping[str, Any]]]]) -> str:
    """Markdown: one row per (step, dataset) with mean@n, std, pass@k and maj@n in percent."""
    first = rows[0][1][next(iter(rows[0][1]))]
    n = first["n"]
    ks = [k for k in first if k.startswith("pass@")]
    metrics = [f"mean@{n}", "std", *ks, f"maj@{n}"]
    lines = [
        "| step | dataset | " + " | ".join(f"{m} (%)" for m in metrics) + " |",
        "|" + "|".join(["---"] * (len(metrics) + 2)) + "|",
    ]
    for step, results in rows:
        for name, s in results.items():
            cells = ["-" if s.get(m) is None else f"{100 * s[m]:.2f}" for m in metrics]
            lines.append(f"| {step} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write_steps(cfg: EvalCLIConfig, targets: list[Target], payloads: list[dict]) -> dict:
    rows = [(t.step, p["results"]) for t, p in zip(targets, payloads)]
    out_dir = Path(cfg.eval.out) if cfg.eval.out else targets[0].run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "eval_steps" + _stem(cfg.eval)[len("eval") :]
    table = steps_table(rows)
    print("\n" + table, flush=True)
    payload = {
        "checkpoint": cfg.checkpoint,
        "config": asdict(cfg.eval),
        "steps": [{"step": s, "results": r} for s, r in rows],
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(table + "\n")
    if cfg.eval.plot:
        from bandpo.viz import plot_steps

        plot_steps(rows, out_dir / f"{stem}.png", title=f"{Path(cfg.checkpoint).name}: accuracy vs step")
    log.info("wrote %s/%s.{json,md,png}", out_dir, stem)
    return payload
