"""A ``bandpo.parts.RunParts`` record of stand-ins, for trainer tests that run the loop without Ray."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from bandpo.config import loss_options
from bandpo.parts import RunParts, Workers, resolve_plan


class NoLog:
    """A metrics log that keeps nothing."""

    def log(self, step, metrics):
        pass

    def truncate_after(self, step):
        pass

    def close(self):
        pass


def fake_parts(
    cfg, out: Path | str = "/nonexistent-run", *, workers: Workers | None = None, **fields
) -> RunParts:
    """The record start-up would return for ``cfg`` on CPU, its workers and data replaced by stand-ins;
    ``fields`` replace any other (``plan``, ``sampler``, ``logger``, ...)."""
    base = dict(
        out=Path(out),
        plan=resolve_plan(cfg, "cpu", "model"),
        tokenizer=None,
        prompts=SimpleNamespace(prompt_ids=[], examples=[]),
        sampler=None,
        eval_sets={},
        loss=loss_options(cfg),
        workers=workers or Workers(),
        sync_tol=None,
        logger=NoLog(),
    )
    return RunParts(**{**base, **fields})
