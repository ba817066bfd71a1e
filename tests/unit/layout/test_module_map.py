"""docs/architecture.md's "Every module, one line each" names every module of bandpo/, studies/ and
benchmarks/, and nothing that is not there (as the configuration key table is kept true to the schema).

The map is a code block of lines ``<names>  <what they do>``: the names are the text before the first
run of two spaces, comma-separated; a name with a slash is a path from the repository root (a folder
when it ends in ``/``), one without is a file in the folder of the line's first name, or, on an
indented line, of the last folder named at the start of a line. A package's ``__init__.py`` is a
module of its own when it defines a function or a class (a dunder such as a lazy ``__getattr__`` aside);
otherwise its folder stands for it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("bandpo", "studies", "benchmarks")
HEADING = "## Every module, one line each"


def module_map(text: str) -> tuple[set[str], set[str]]:
    """(files, folders) the map names, as paths from the repository root."""
    section = text.split(HEADING, 1)[1]
    block = section.split("```", 2)[1]  # the first code block of the section
    files, folders, folder = set(), set(), ""
    for line in block.splitlines()[1:]:  # [0]: the rest of the fence line
        if not line.strip():
            continue
        names = [n.strip() for n in re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split(",")]
        if not line.startswith(" "):
            first = names[0]
            folder = first if first.endswith("/") else first.rsplit("/", 1)[0] + "/"
        for name in names:
            path = name if "/" in name else folder + name
            (folders if path.endswith("/") else files).add(path.rstrip("/"))
    return files, folders


def _defines_something(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(
        isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not n.name.startswith("__")
        for n in tree.body
    )


def modules() -> set[str]:
    """Every module the map must name (repository-relative paths)."""
    out = set()
    for top in PACKAGES:
        for path in (REPO / top).rglob("*.py"):
            if path.name != "__init__.py" or _defines_something(path):
                out.add(str(path.relative_to(REPO)))
    return out


def test_the_map_parses_its_forms():
    doc = (
        "x\n" + HEADING + "\n\n```\nbandpo/a.py, b.py  what\nbandpo/c/  a package:\n  d.py   one\n\n"
        "studies/e/f.py  g.py is in the text, not a name\n```\n"
    )
    assert module_map(doc) == (
        {"bandpo/a.py", "bandpo/b.py", "bandpo/c/d.py", "studies/e/f.py"},
        {"bandpo/c"},
    )


def test_every_module_has_its_line_in_the_architecture_map():
    files, folders = module_map(DOC.read_text())
    missing = sorted(modules() - files)
    assert not missing, f"modules without a line in {DOC.relative_to(REPO)} ({HEADING[3:]}): {missing}"
    gone = sorted(p for p in files if not (REPO / p).is_file()) + sorted(
        p + "/" for p in folders if not (REPO / p).is_dir()
    )
    assert not gone, f"{DOC.relative_to(REPO)} names what is not there: {gone}"
