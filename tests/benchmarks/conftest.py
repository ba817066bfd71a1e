"""Every test under tests/benchmarks/ is marked ``benchmark`` (the benchmarks' code: benchmarks/), so
that its time is reported apart and ``-m "not benchmark"`` leaves it out."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.benchmark)
