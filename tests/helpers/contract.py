"""Helpers of the API contract tests (tests/unit/contracts/test_contract_*.py): calls into a library, found
in bandpo's own source, bound to the installed library's signatures.

``library_calls(package)`` reads every module of ``bandpo`` (AST, nothing imported) and returns
each call whose callee is a name imported from ``package`` (``from vllm import LLM`` ... ``LLM(...)``,
``import deepspeed`` ... ``deepspeed.zero.GatheredParameters(...)``), with its positional count
and keyword names. ``method_calls(receiver)`` finds the calls through an object instead (``self.llm.sleep(level=1)``
for ``self.llm``), to be bound to the class that object is. ``bind_errors`` resolves each callee in
the installed package (or takes it from the class) and binds the call: a renamed function, class,
method or keyword fails, naming the file and line. Constant arguments are kept, so the tests can
check values too (a ``collective_rpc`` target, a placement strategy).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "bandpo"


@dataclass(frozen=True)
class Call:
    where: str  # file:line
    target: str  # dotted name in the library ("deepspeed.initialize"), or the method's name
    positional: int
    keywords: tuple[str, ...]
    starred: bool  # *args or **kwargs in the call: only what is spelled out is bound
    # argument index / keyword -> constant
    constants: dict = field(default_factory=dict, hash=False, compare=False)


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _record(where: str, target: str, node: ast.Call) -> Call:
    def const(v):
        if isinstance(v, ast.Tuple):  # its length counts even where an element is computed (Ellipsis there)
            return tuple(x if x is not _UNKNOWN else ... for x in map(const, v.elts))
        try:
            return ast.literal_eval(v)
        except ValueError:
            return _UNKNOWN

    consts = {i: const(a) for i, a in enumerate(node.args) if not isinstance(a, ast.Starred)}
    consts.update({k.arg: const(k.value) for k in node.keywords if k.arg})
    starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
    return Call(
        where,
        target,
        sum(not isinstance(a, ast.Starred) for a in node.args),
        tuple(k.arg for k in node.keywords if k.arg),
        starred,
        {k: v for k, v in consts.items() if v is not _UNKNOWN},
    )


_UNKNOWN = object()


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield f"{path.relative_to(ROOT.parent)}", ast.parse(path.read_text(), str(path))


def library_calls(package: str) -> list[Call]:
    calls = []
    for rel, tree in _modules():
        # local name -> dotted name in the package (file-wide: imports are unambiguous here)
        names: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == package:
                        names[a.asname or package] = a.name if a.asname else package
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            parts = _dotted(node.func) if isinstance(node, ast.Call) else None
            if parts and parts[0] in names:
                calls.append(_record(f"{rel}:{node.lineno}", ".".join([names[parts[0]], *parts[1:]]), node))
    return calls


def method_calls(receiver: str, under: str = "") -> list[Call]:
    """Calls ``<receiver>.<method>(...)`` (e.g. ``self.llm``) in bandpo's modules whose path starts with ``under``."""
    chain = receiver.split(".")
    calls = []
    for rel, tree in _modules():
        if not rel.startswith(under):
            continue
        for node in ast.walk(tree):
            parts = _dotted(node.func) if isinstance(node, ast.Call) else None
            if parts and parts[:-1] == chain:
                calls.append(_record(f"{rel}:{node.lineno}", parts[-1], node))
    return calls


def calls_of_method(name: str) -> list[Call]:
    """Every ``<anything>.<name>(...)`` call in bandpo's modules (e.g. Ray's ``.options``)."""
    return [
        _record(f"{rel}:{node.lineno}", name, node)
        for rel, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
    ]


def attributes_of(receiver: str, under: str = "") -> set[str]:
    """Every attribute read from ``<receiver>`` (``self.engine.module`` -> ``module``), called or not."""
    chain = receiver.split(".")
    found = set()
    for rel, tree in _modules():
        if rel.startswith(under):
            found |= {
                node.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and _dotted(node.value) == chain
            }
    return found


def resolve(dotted: str):
    """The object ``dotted`` names in the installed package (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(dotted)


def bind_errors(calls: list[Call], owner: type | None = None) -> tuple[list[str], int]:
    """``(errors, bound)``: a line per call that does not fit the installed library; how many were bound.

    With ``owner`` the calls are methods of that class (``method_calls``), else dotted names.
    """
    errors, bound = [], 0
    for c in calls:
        try:
            obj = getattr(owner, c.target) if owner is not None else resolve(c.target)
        except (ImportError, AttributeError) as e:
            errors.append(f"{c.where}: {c.target} not in the installed package ({e})")
            continue
        try:
            sig = inspect.signature(obj)
        # a C function / builtin without a signature: existence is all we know
        except (TypeError, ValueError):
            continue
        bind = sig.bind_partial if c.starred else sig.bind
        # a plain function on the class takes self; static- and classmethods do not
        self_arg = (
            [object()]
            if owner is not None and inspect.isfunction(inspect.getattr_static(owner, c.target))
            else []
        )
        try:
            bind(*self_arg, *[object()] * c.positional, **{k: object() for k in c.keywords})
        except TypeError as e:
            errors.append(f"{c.where}: {c.target}{sig}: {e}")
            continue
        bound += 1
    return errors, bound


def binds(func, *args, **kwargs) -> None:
    """Raise ``TypeError`` unless ``func``'s signature accepts these arguments."""
    inspect.signature(func).bind(*args, **kwargs)
