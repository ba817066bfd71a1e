#!/usr/bin/env bash
# Run the test suite: creates/updates .venv first (scripts/setup.sh), then pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not integration"` or `-k band`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec .venv/bin/python -m pytest "$@"
