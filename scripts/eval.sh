#!/usr/bin/env bash
# Evaluate a checkpoint: mean@n (+ std over problems), pass@k, maj@n per dataset.
# Arguments are Hydra-style overrides, forwarded to `python -m bandpo.eval`:
#   scripts/eval.sh checkpoint=PATH eval.datasets=[amc23,aime24,aime25] eval.n=32
#   scripts/eval.sh checkpoint=runs/NAME [step=N | steps=all] ...   (or runs/NAME/checkpoints/step_N)
#   scripts/eval.sh checkpoint=runs/NAME/hf_adapter [base_model=PATH] ...   (a PEFT LoRA adapter, merged first)
#   scripts/eval.sh checkpoint=PATH eval.paths=data/eval eval.n=4 eval.max_tokens=512 --out /tmp/eval
# Creates .venv first (scripts/setup.sh) when it is missing. Relative paths stay relative
# to the directory you call it from.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${BANDPO_VENV:-.venv}
[[ $VENV == /* ]] || VENV="$ROOT/$VENV"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || bash "$ROOT/scripts/setup.sh"
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
exec "$PY" -m bandpo.eval "$@"
