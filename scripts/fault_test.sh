#!/usr/bin/env bash
# Fault test: train with the given overrides, SIGKILL the whole run (driver, Ray, workers) at
# random moments (--kills, default 5; one of them mid-checkpoint), resume it each time, then
# check it against an uninterrupted run: every step logged once, same per-step metrics, same
# final weights, no temporary checkpoint or orphan process left. Exit 1 on any violation.
#   scripts/fault_test.sh --kills 3 trainer.total_steps=6 trainer.save_every=2
# Outputs: runs/fault_test/{reference,killed,logs}, runs/fault_test/fault_test.json (--out).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m bandpo.tools.fault_test "$@"
