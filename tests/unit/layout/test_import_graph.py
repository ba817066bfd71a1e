"""The import graph of the repository's packages (bandpo/, studies/, benchmarks/, tests/; read from
the source, nothing imported): no cycles anywhere; the light packages stay off the Ray / engine side;
the lower packages import no higher one (``BELOW``); the product imports none of the studies,
benchmarks or tests, and those import only bandpo's public names.

Every ``import bandpo...`` and ``from bandpo... import ...`` counts (and the same for the other
packages), at module level and inside functions (a function-level import still ties the two modules
together: moving one breaks the other). ``from bandpo.x import y`` is an edge to ``bandpo.x.y`` when
that is a module, else to ``bandpo.x``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The top-level packages the graph covers: the product, then what is built on it. studies/ and
# benchmarks/ are not installed with the wheel; they import from the repository root.
PACKAGES = ("bandpo", "studies", "benchmarks", "tests")
PRODUCT = ("bandpo",)
ON_TOP = ("studies", "benchmarks")  # use bandpo's public names only, and nothing of tests/

# bandpo.algo and bandpo.reward import without Ray, vLLM or DeepSpeed (tests/unit/layout/test_imports.py):
# they must not depend on the packages that start workers.
LIGHT = ("bandpo.algo", "bandpo.reward")
HEAVY = ("bandpo.trainer", "bandpo.actor", "bandpo.rollout", "bandpo.distributed")
# Packages below others: {package: the packages it must not import, directly or inside a function}.
# The trainer and the actor are built from the first ones; the shm weight file is the transports'
# (bandpo.weight_sync imports it). bandpo.config validates what the trainer, the actor and the
# evaluation run with, from rules it shares with them (bandpo.config.checks): it imports none of them,
# nor the parts built from it (bandpo.parts).
UPPER = ("bandpo.trainer", "bandpo.train", "bandpo.actor")
BELOW = {
    **dict.fromkeys(
        (
            "bandpo.checkpoint",
            "bandpo.data",
            "bandpo.algo",
            "bandpo.reward",
            "bandpo.distributed",
            "bandpo.run",
            "bandpo.rollout",
            "bandpo.weight_sync",
            "bandpo.flat_buffer",
            "bandpo.lora_weights",
        ),
        UPPER,
    ),
    "bandpo.shm": (*UPPER, "bandpo.weight_sync"),
    "bandpo.config": (*UPPER, "bandpo.eval", "bandpo.parts"),
}
# The typed config's schema is the bottom of the graph: it imports nothing else from bandpo.
LEAVES = ("bandpo.config.schema",)


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``PACKAGES`` (packages by their __init__;
    test files by their path, as pytest's importlib mode names them)."""
    out = {}
    for path in sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The repository's modules one module's source imports, anywhere in it."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if _ours(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _ours(node.module):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def imported_names(tree: ast.AST) -> set[str]:
    """Every dotted name one module's source imports from the repository's packages: ``import a.b`` as
    ``a.b``, ``from a.b import c`` as ``a.b.c`` (a module or a name in it)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if _ours(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _ours(node.module):
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@functools.cache  # parsed once for all the tests here
def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {
        name: imported(ast.parse(path.read_text(), str(path)), modules) - {name}
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt) and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports, directly or not: module -> the module that imports it."""
    via, todo = {}, [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in via and n != start:
                via[n] = m
                todo.append(n)
    return via


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_graph_sees_the_packages():
    graph = import_graph()
    assert "bandpo.config" in graph and "bandpo.distributed.plan" in graph
    assert "bandpo.config.rules" in graph["bandpo.config"]
    assert "bandpo.errors" in graph["bandpo.config.keys"]
    assert {"studies.entropy.design", "studies.entropy.verdict"} <= graph["studies.entropy.stage2"]
    assert "benchmarks.common" in graph["benchmarks.actor"]
    assert "tests.helpers.actor" in graph["tests.integration.actor.test_actor_gpu"]
    assert "studies.entropy.stats" in graph["tests.studies.entropy.test_stage0"]


def test_find_cycle_reports_the_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_light_packages_do_not_import_worker_packages():
    graph = import_graph()
    bad = []
    for name in sorted(m for m in graph if _in(m, LIGHT)):
        via = reachable(graph, name)
        for target in sorted(t for t in via if _in(t, HEAVY)):
            chain = [target]
            while chain[-1] != name and chain[-1] in via:
                chain.append(via[chain[-1]])
            if chain[-1] != name:
                chain.append(name)
            bad.append(" -> ".join(reversed(chain)))
    assert not bad, "light package imports a worker package:\n" + "\n".join(bad)


def test_lower_packages_do_not_import_higher_ones():
    graph = import_graph()
    bad = [
        f"{name} -> {target}"
        for lower, higher in BELOW.items()
        for name in sorted(m for m in graph if _in(m, (lower,)))
        for target in sorted(graph[name])
        if _in(target, higher)
    ]
    assert not bad, "a lower package imports a higher one:\n" + "\n".join(bad)


def test_the_product_imports_no_study_benchmark_or_test():
    graph = import_graph()
    bad = [f"{name} -> {target}" for name in sorted(graph) if _in(name, PRODUCT)
           for target in sorted(graph[name]) if not _in(target, PRODUCT)]  # fmt: skip
    assert not bad, "bandpo imports outside the product:\n" + "\n".join(bad)


def test_studies_and_benchmarks_use_public_names_of_bandpo_and_no_tests():
    """Public: no part of the dotted name starts with ``_`` (``bandpo.viz._cut`` and ``bandpo._x.y`` are
    private). What they use of the trainer's internals is not restricted here."""
    bad = []
    for name, path in module_files().items():
        if not _in(name, ON_TOP):
            continue
        for target in sorted(imported_names(ast.parse(path.read_text(), str(path)))):
            private = _in(target, PRODUCT) and any(p.startswith("_") for p in target.split("."))
            if private or _in(target, ("tests",)):
                bad.append(f"{name} -> {target}")
    assert not bad, "a study or benchmark imports a private name of bandpo, or a test module:\n" + "\n".join(
        bad
    )


def test_the_schema_is_a_leaf():
    graph = import_graph()
    for leaf in LEAVES:
        assert leaf in graph
        assert graph[leaf] == set(), f"{leaf} imports {sorted(graph[leaf])}"
