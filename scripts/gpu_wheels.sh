#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has torch, transformers and pytest, but no Hydra, DeepSpeed
# or pydantic, and no network), fetched here into .whl/ (git-ignored) for scripts/gpu_round4.sh, which
# pip-installs them there with --no-index --no-deps. The versions are this venv's, so the machine
# runs what the CPU tests ran. DeepSpeed and antlr4 publish source only: built here into
# pure-Python wheels (DeepSpeed's ops are compiled at run time, not at build). Target: CPython 3.12.
#   bash scripts/gpu_wheels.sh            # then run the device command with carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
rm -rf .whl && mkdir -p .whl
binary=(hydra-core omegaconf peft hjson pydantic pydantic-core annotated-types typing-inspection)
pins=()
for name in "${binary[@]}"; do pins+=("$name==$(version "$name")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl \
    "deepspeed==$(version deepspeed)" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
ls -l .whl
du -sh .whl
