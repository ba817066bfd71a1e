"""docs/configuration.md's table of every key, written from the schema (``bandpo.config.schema``).

    python -m bandpo.config.reference            # rewrite the table between the markers in docs/configuration.md
    python -m bandpo.config.reference --check    # exit 1 when the file's table is not the schema's

A test runs the check, so the page cannot drift from the schema.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path

from bandpo.config import schema

BEGIN = "<!-- keys: written by python -m bandpo.config.reference; do not edit by hand -->"
END = "<!-- keys: end -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _type_name(tp) -> str:
    if dataclasses.is_dataclass(tp):
        return "section"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" \\| null" if type(None) in args else "")
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "" if dataclasses.is_dataclass(value) else f"`{value}`"
    value = f.default
    return "`null`" if value is None else f"`{str(value).lower() if isinstance(value, bool) else value}`"


def rows(cls=schema.TrainConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) of every key under ``cls``, sections before their keys."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        out.append((key, _type_name(tp), _default(f), f.metadata.get("doc", "")))
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            out += rows(inner[0], key + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            out += rows(typing.get_args(tp)[0], key + ".<i>.")
    return out


def table() -> str:
    lines = ["| key | type | default | what it is |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | {d} | {doc.replace('|', chr(92) + '|')} |" for k, t, d, doc in rows()]
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """``text`` with the part between the markers replaced by the schema's table."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = rewrite(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is not the schema's table: run python -m bandpo.config.reference", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
