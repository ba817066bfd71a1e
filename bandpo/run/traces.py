"""Rollout traces: what the policy wrote, how it was graded, and what the update saw.

Every ``trainer.trace_every`` steps the trainer writes ``<run>/traces/step_<N>.jsonl``, one
JSON object per prompt group (the groups the update trained on):

    {"step", "group", "id", "prompt", "gold", "reward_mean", "accuracy",
     "responses": [{"text", "extracted", "status", "reward", "advantage", "length", "finish_reason"}]}

and, at each evaluation while tracing is on, ``traces/eval_step_<N>.jsonl`` (one object per
problem, ``dataset`` added, ``advantage`` absent). Texts are cut to ``max_chars``
characters, keeping the head and the tail (the answer line is at the end).

Quick look at a step's best and worst groups:

    python -m bandpo.run.traces runs/X --step 10 [--top 3] [--eval]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bandpo.checkpoint.atomic import write_text_atomic


def cut(text: str | None, max_chars: int) -> str | None:
    """``text`` within ``max_chars``: head + a marker naming how much was cut + tail."""
    if text is None or len(text) <= max_chars:
        return text
    keep = max(max_chars - 32, 2)
    head, tail = text[: keep // 2], text[len(text) - (keep - keep // 2) :]
    return f"{head} [... {len(text) - keep} chars cut ...] {tail}"


def group_records(
    step: int,
    prompt_ids: Sequence[str],
    prompts: Sequence[str],
    golds: Sequence[str],
    texts: Sequence[str],
    scores: Sequence,
    advantages: Sequence[float] | None,
    prompt_index: Sequence[int],
    lengths: Sequence[int],
    finish_reasons: Sequence[str],
    max_chars: int,
) -> list[dict]:
    """One record per prompt group. Per-prompt lists have B entries; per-row lists N (row r
    answers prompt ``prompt_index[r]``); ``scores`` carry ``reward``, ``status``, ``extracted``."""
    rows_of: list[list[int]] = [[] for _ in prompts]
    for row, i in enumerate(prompt_index):
        rows_of[i].append(row)
    out = []
    for g, rows in enumerate(rows_of):
        responses = [
            {
                "text": cut(texts[r], max_chars),
                "extracted": cut(scores[r].extracted, max_chars),
                "status": str(scores[r].status),
                "reward": float(scores[r].reward),
                **({} if advantages is None else {"advantage": float(advantages[r])}),
                "length": int(lengths[r]),
                "finish_reason": finish_reasons[r] if finish_reasons else "unknown",
            }
            for r in rows
        ]
        n = max(len(rows), 1)
        out.append(
            {
                "step": step,
                "group": g,
                "id": prompt_ids[g],
                "prompt": cut(prompts[g], max_chars),
                "gold": golds[g],
                "reward_mean": sum(x["reward"] for x in responses) / n,
                "accuracy": sum(x["status"] == "correct" for x in responses) / n,
                "responses": responses,
            }
        )
    return out


def eval_records(step: int, samples: dict[str, list[dict]], max_chars: int) -> list[dict]:
    """Records of ``bandpo.eval.evaluate.evaluate(..., keep_samples=True)``'s per-problem samples."""
    out = []
    for name, problems in samples.items():
        for p in problems:
            responses = [
                {
                    "text": cut(t, max_chars),
                    "extracted": cut(e, max_chars),
                    "status": s,
                    "correct": c,
                    "length": n,
                    "finish_reason": f,
                }
                for t, e, s, c, n, f in zip(
                    p["responses"], p["extracted"], p["status"], p["correct"], p["length"], p["finish_reason"]
                )
            ]
            out.append(
                {
                    "step": step,
                    "dataset": name,
                    "id": p["id"],
                    "gold": p["answer"],
                    "accuracy": sum(p["correct"]) / max(len(p["correct"]), 1),
                    "responses": responses,
                }
            )
    return out


def write_records(path: Path, records: Sequence[dict]) -> Path:
    """Write ``records`` as JSONL, atomically (a resumed run rewrites the same step's file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def write_round_trace(folder: Path, step: int, examples: Sequence, rnd, max_chars: int) -> Path:
    """The groups of a step's batch (``rnd``: ``bandpo.trainer.dynamic_sampling.Round``; ``examples``
    indexed by its ``idx``) with texts, grades and advantages, to ``folder/step_<step>.jsonl``."""
    ex = [examples[i] for i in rnd.idx]
    b = rnd.batch
    records = group_records(
        step,
        [e.id for e in ex],
        [e.problem for e in ex],
        [e.answer for e in ex],
        rnd.texts,
        rnd.scores,
        b.advantages.tolist(),
        b.prompt_index.tolist(),
        b.response_lengths.tolist(),
        b.finish_reasons,
        max_chars,
    )
    return write_records(folder / f"step_{step}.jsonl", records)


def read_records(path: Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarize(records: Sequence[dict], top: int = 3, responses: int = 2) -> str:
    """The ``top`` best and worst groups by mean reward (accuracy for eval records), as text."""
    key = "reward_mean" if records and "reward_mean" in records[0] else "accuracy"
    ranked = sorted(records, key=lambda r: (r[key], r.get("group", 0)))
    flat = sum(len({x["status"] for x in r["responses"]}) == 1 for r in records)
    lines = [
        f"{len(records)} groups, mean {key} {sum(r[key] for r in records) / max(len(records), 1):+.3f}, "
        f"{flat} with a single status"
    ]
    for title, chosen in (("best", ranked[::-1][:top]), ("worst", ranked[:top])):
        lines.append(f"\n== {title} {len(chosen)} by {key} ==")
        for r in chosen:
            where = r.get("dataset", f"group {r.get('group')}")
            lines.append(f"\n[{where} id={r['id']}] {key}={r[key]:+.3f} gold={r['gold']!r}")
            if r.get("prompt"):
                lines.append(f"  prompt: {_one_line(r['prompt'], 300)}")
            statuses = ", ".join(sorted({x["status"] for x in r["responses"]}))
            lines.append(f"  {len(r['responses'])} responses; statuses: {statuses}")
            for x in r["responses"][:responses]:
                adv = f" adv={x['advantage']:+.2f}" if "advantage" in x else ""
                lines.append(
                    f"  - {x['status']} extracted={x['extracted']!r}{adv} len={x['length']}: "
                    f"{_one_line(x['text'], 300)}"
                )
    return "\n".join(lines)


def _one_line(text: str | None, limit: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bandpo.run.traces", description="Best and worst groups of a traced step."
    )
    ap.add_argument("run", help="run folder (trainer.output_dir)")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--responses", type=int, default=2, help="responses shown per group")
    ap.add_argument("--eval", action="store_true", help="the step's evaluation samples instead")
    args = ap.parse_args(argv)
    path = Path(args.run) / "traces" / f"{'eval_' if args.eval else ''}step_{args.step}.jsonl"
    if not path.exists():
        have = sorted(p.name for p in (Path(args.run) / "traces").glob("*.jsonl"))
        print(
            f"no trace {path}; traced: {', '.join(have) or 'none (set trainer.trace_every)'}", file=sys.stderr
        )
        return 2
    print(summarize(read_records(path), args.top, args.responses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
