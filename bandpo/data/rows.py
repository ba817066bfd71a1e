"""Raw rows to ``Example`` records (``bandpo.types``): a local file's rows, and the field mapping.

``read_rows`` reads a .jsonl / .json / .parquet file; ``examples_from_rows`` maps rows (from a
file, the hub or a generated set) to examples: keys as dotted paths into nested rows
(``get_path``), chat message lists and DAPO-wrapped prompts as the bare problem, "\\boxed{N}" and
27.0 answers as "N" and "27", MATH levels filtered, repeated problems dropped, and rows whose
problem or answer is missing or empty skipped (the count and the first few ids logged).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from bandpo.data.prompts import strip_instruction
from bandpo.errors import InputError
from bandpo.types import Example

log = logging.getLogger(__name__)

MAX_LOGGED_IDS = 5


def read_rows(path: Path) -> list[dict]:
    """Rows of a .jsonl, .json or .parquet file as dicts; malformed content is an ``InputError`` naming
    the file (and the line of a .jsonl)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8")
        if suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, list):
                raise InputError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
            return data
    except InputError:
        raise
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, invalid JSON, not parquet (ArrowInvalid)
        from bandpo.hub import first_line

        raise InputError(f"{path}: cannot read it ({type(e).__name__}: {first_line(e)})") from e
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(row, dict):
            raise InputError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
    return rows


def examples_from_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    problem_key: str = "problem",
    answer_key: str = "answer",
    id_key: str | None = "id",
    source: str,
    where: str,
    levels: Iterable[int] | None = None,
    level_key: str = "level",
    dedup: bool = False,
) -> list[Example]:
    """Map raw rows to examples, skipping rows with a missing/empty problem or answer.

    The row's problem goes through ``strip_instruction`` (chat lists and DAPO-wrapped
    prompts become the bare problem, so templates are never applied twice). Ids default
    to ``<source>-<row index>``. Raises ``InputError`` when no row has ``problem_key`` or
    ``answer_key`` at all (a wrong mapping rather than bad rows), naming the keys present.
    """
    keep_levels = set(levels) if levels is not None else None
    examples: list[Example] = []
    skipped: list[str] = []
    seen_problem = seen_answer = False
    first_keys: list[str] = []
    n_level_filtered = n_dupes = 0
    seen_texts: set[str] = set()
    for i, row in enumerate(rows):
        if i == 0:
            first_keys = list(row.keys())
        raw_id = get_path(row, id_key) if id_key else None
        ex_id = f"{source}-{i}" if raw_id is _MISSING or raw_id is None or raw_id == "" else str(raw_id)
        problem_raw, answer_raw = get_path(row, problem_key), get_path(row, answer_key)
        seen_problem |= problem_raw is not _MISSING
        seen_answer |= answer_raw is not _MISSING
        problem, answer = _as_problem(problem_raw), _as_answer(answer_raw)
        if not problem or not answer:
            skipped.append(ex_id)
            continue
        if keep_levels is not None and _parse_level(get_path(row, level_key)) not in keep_levels:
            n_level_filtered += 1
            continue
        if dedup:
            if problem in seen_texts:
                n_dupes += 1
                continue
            seen_texts.add(problem)
        examples.append(Example(id=ex_id, problem=problem, answer=answer, source=source))
    for key, seen in ((problem_key, seen_problem), (answer_key, seen_answer)):
        if first_keys and not seen:
            raise InputError(f"{where}: no row has the key {key!r}; the first row has keys {first_keys}")
    if skipped:
        log.warning(
            "%s: skipped %d row(s) with a missing or empty problem/answer (first ids: %s)",
            where,
            len(skipped),
            ", ".join(skipped[:MAX_LOGGED_IDS]),
        )
    if n_level_filtered:
        log.info("%s: kept levels %s, filtered out %d row(s)", where, sorted(keep_levels), n_level_filtered)
    if n_dupes:
        log.info("%s: dropped %d duplicate problem(s)", where, n_dupes)
    log.info("%s: %d example(s)", where, len(examples))
    return examples


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def get_path(row: Any, key: str) -> Any:
    """``row["a"]["b"][0]`` for ``key="a.b.0"``; ``_MISSING`` when any step is absent."""
    cur = row
    for part in key.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif _is_index(cur, part):
            cur = cur[int(part)]
        else:
            return _MISSING
    return cur


def _is_index(seq: Any, part: str) -> bool:
    if not isinstance(seq, (list, tuple)) or re.fullmatch(r"-?\d+", part) is None:
        return False
    return -len(seq) <= int(part) < len(seq)


def _as_problem(value: Any) -> str:
    if value is _MISSING or value is None:
        return ""
    if isinstance(value, (list, tuple)):  # a chat message list: the last user turn holds the problem
        users = [
            m.get("content", "") for m in value if isinstance(m, Mapping) and m.get("role", "user") == "user"
        ]
        value = users[-1] if users else ""
    return strip_instruction(str(value)).strip()


_BOXED = re.compile(r"^\s*\\boxed\s*\{(.*)\}\s*$", re.DOTALL)


def _as_answer(value: Any) -> str:
    if value is _MISSING or value is None:
        return ""
    if isinstance(value, float) and value.is_integer():  # parquet/pandas often store AMC answers as 27.0
        value = int(value)
    text = str(value).strip()
    boxed = _BOXED.match(text)  # some sets (math-ai/aime24) give the answer as "\boxed{N}"
    return boxed.group(1).strip() if boxed else text


def _parse_level(value: Any) -> int | None:
    """MATH levels appear as 3 or "Level 3"; anything else (e.g. "Level ?") is None."""
    if isinstance(value, int):
        return value
    m = re.search(r"\d+", str(value)) if value is not _MISSING and value is not None else None
    return int(m.group()) if m else None
