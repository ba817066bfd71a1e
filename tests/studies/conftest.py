"""Every test under tests/studies/ is marked ``study`` (the studies' code: studies/), so that its time
is reported apart and ``-m "not study"`` leaves it out."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.study)
