"""Every Python file of the project reads in one sitting: at most 500 lines (after ruff format, which
CI checks), so a file that outgrows it is split by concern instead of growing on."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MAX_LINES = 500
FOLDERS = ("bandpo", "studies", "benchmarks", "scripts", "recipes", "tests", "docker")


def test_no_python_file_is_longer_than_500_lines():
    files = [p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")]
    assert len(files) > 100  # the walk found the project, not an empty folder
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"
