"""bandpo.weight_sync is imported by the rollout and actor packages, never the other way round."""

import ast
import subprocess
import sys
from pathlib import Path

import bandpo.weight_sync

PACKAGE = Path(bandpo.weight_sync.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` in ``path`` names, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_weight_sync_imports_neither_rollout_nor_actor():
    # bandpo.shm's weight file is the shm transport's: held to the same rule.
    for path in sorted([*PACKAGE.glob("*.py"), *(PACKAGE.parent / "shm").glob("*.py")]):
        bad = {
            m
            for m in _imported_modules(path)
            if m.split(".")[:2] in (["bandpo", "rollout"], ["bandpo", "actor"])
        }
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_the_weight_file_module_does_not_pull_in_ray():
    # The fault test imports driver_weight_files from it and must stay free of Ray.
    code = "import sys, bandpo.shm.weight_files; print(sorted(m for m in ('ray', 'vllm', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
