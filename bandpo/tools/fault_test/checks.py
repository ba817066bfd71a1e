"""Checks of a killed-and-resumed run against an uninterrupted one. Each returns violations
(human-readable strings); an empty list means the check passed."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from bandpo.checkpoint import safe_load

STEP_RE = re.compile(r"^step_\d{6,}$")
# Compared per step; they depend on the rollouts, the rewards and the weights before the update.
DEFAULT_KEYS = ("reward/mean", "actor/loss", "actor/entropy", "actor/grad_norm", "response/length_mean")


def read_metrics(run: Path) -> list[dict]:
    """The rows of ``run/metrics.jsonl``; a line that does not parse becomes ``{"unparsable": text}``."""
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append({"unparsable": line})
    return rows


def check_steps(rows: list[dict], reference: list[dict], total_steps: int) -> list[str]:
    """Training steps 1..total exactly once and in order; eval-only rows (step 0, ``final``) as in the reference."""
    out = [
        f"metrics.jsonl has an unparsable line: {r['unparsable'][:80]!r}" for r in rows if "unparsable" in r
    ]
    train = [r.get("step") for r in rows if is_train_row(r)]
    if train != list(range(1, total_steps + 1)):
        out.append(f"metrics.jsonl training steps are {train}, expected 1..{total_steps} once each")
    shape, ref_shape = [_row_kind(r) for r in rows], [_row_kind(r) for r in reference]
    if shape != ref_shape:
        out.append(f"metrics.jsonl rows (step, kind) {shape} differ from the uninterrupted run's {ref_shape}")
    return out


def check_step_metrics(
    rows: list[dict], reference: list[dict], keys=DEFAULT_KEYS, rel: float = 1e-4, abs_tol: float = 1e-6
) -> list[str]:
    """Per training step, ``keys`` within ``rel`` (plus ``abs_tol`` near zero) of the reference's."""
    ref = {r["step"]: r for r in reference if is_train_row(r)}
    out = []
    for row in (r for r in rows if is_train_row(r)):
        want = ref.get(row["step"])
        if want is None:
            continue  # reported by check_steps
        for key in keys:
            a, b = row.get(key), want.get(key)
            if a is None and b is None:
                continue
            if not _close(a, b, rel, abs_tol):
                out.append(f"step {row['step']}: {key} = {a} after kills, {b} uninterrupted")
    return out


def final_weights(run: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """Where the final weights are (``hf/model.safetensors``, else the latest checkpoint) and the tensors."""
    hf = run / "hf" / "model.safetensors"
    if hf.exists():
        from safetensors.torch import load_file

        return str(hf), load_file(hf)
    folder = latest_folder(run)
    if folder is None:
        return "none", {}
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted((folder / "actor").rglob("*model_states.pt")):
        state = safe_load.load(file, safe_load.deepspeed_globals(), map_location="cpu")
        _flatten(state.get("module", {}), file.name, tensors)
    return str(folder / "actor"), tensors


def check_weights(run: Path, reference: Path, tol: float = 1e-6) -> tuple[list[str], float]:
    """The final weights of ``run`` equal ``reference``'s within ``tol`` (max abs); also returns that max."""
    (where, a), (ref_where, b) = final_weights(run), final_weights(reference)
    if not a or not b:
        return [f"no final weights to compare ({where} vs {ref_where})"], math.nan
    if a.keys() != b.keys():
        return [
            f"{where} and {ref_where} hold different tensors: {sorted(a.keys() ^ b.keys())[:5]}"
        ], math.nan
    diff = max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()), default=0.0)
    bad = not diff <= tol  # NaN counts as a difference
    return (
        [f"final weights differ from the uninterrupted run's by {diff:.3g} (max abs) > {tol}"] if bad else []
    ), diff


def latest_folder(run: Path) -> Path | None:
    pointer = run / "checkpoints" / "latest"
    return run / "checkpoints" / pointer.read_text().strip() if pointer.exists() else None


def check_latest(run: Path) -> tuple[list[str], str | None]:
    """``latest`` (if any) names a complete checkpoint; returns the violations and the folder name."""
    pointer = run / "checkpoints" / "latest"
    if not pointer.exists():
        return [], None
    name = pointer.read_text().strip()
    folder = pointer.parent / name
    state = folder / "trainer_state.json"
    problems = []
    if not STEP_RE.match(name):
        problems.append(f"{pointer} names {name!r}, not a step folder")
    elif not (folder / "actor" / "state").is_dir():
        problems.append(f"{pointer} names {name}, which has no actor/state")
    else:
        try:
            json.loads(state.read_text())["step"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{pointer} names {name}, whose {state.name} is unreadable ({e})")
    return problems, name


def leftovers(run: Path) -> list[str]:
    """Temporary or half-written files and folders under ``run`` (wandb's own folder aside):
    ``.tmp-step_*`` (run checkpoints), ``*.tmp`` (actor staging, HF export, metrics rewrite),
    ``.latest.tmp-*`` (pointer), ``*.old`` (a replaced checkpoint)."""
    found = [
        p
        for p in run.rglob("*")
        if "wandb" not in p.relative_to(run).parts and (".tmp" in p.name or p.name.endswith(".old"))
    ]
    return [f"left behind: {p.relative_to(run)}" for p in sorted(found)]


def is_train_row(row: dict) -> bool:
    return "unparsable" not in row and not row.get("final") and row.get("step", 0) > 0


def _row_kind(row: dict) -> tuple:
    return row.get("step"), "final" if row.get("final") else ("train" if is_train_row(row) else "eval")


def _close(a, b, rel: float, abs_tol: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)
    return a == b  # "nan"/"inf" are logged as strings


def _flatten(obj, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}", out)
