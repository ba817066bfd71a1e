#!/usr/bin/env bash
# The next lent GPU machine's run, prepared: one device command, at most 9 minutes, raw output under
# $OUT for committing to docs/gpu-runs/<date>-<gpu>/. The machine has torch (2.11 on the H200s lent so
# far), transformers and pytest-timeout, but no Ray or vLLM and no network: DeepSpeed, Hydra, PEFT and
# pydantic travel as wheels made here by scripts/gpu_wheels.sh (.whl/, git-ignored: name it in carry).
#   bash scripts/gpu_wheels.sh
#   device run, carry [".whl"], timeout_s 600:  bash scripts/gpu_round4.sh
# In order (wall seconds, each bounded by `timeout`):
#   env.txt          GPU, driver, CPU, RAM, locked-memory limit, library versions            ~10
#   ipc_probe.txt    the IPC bucket across two processes with PYTORCH_CUDA_ALLOC_CONF=
#                    expandable_segments:True (bandpo.tools.gpu_smoke.ipc_probe), then the
#                    control: a tensor from the expandable pool, through pidfd_getfd           <= 60
#   gpu_smoke.txt/.json  python -m bandpo.tools.gpu_smoke (ZeRO-2/3 with the reference model,
#                    LoRA at ZeRO-2/3, IPC GB/s), side by side with
#   gpu_tests.txt    the gpu-marked tests, 150 s each (each builds its own actor)             <= 420
# The smoke test and the tests share the GPU (139 GiB: the smoke's 1.5B model and the tests' tiny
# ones fit together): its seconds and MFU are then upper bounds, its pass/fail columns are not.
set -uo pipefail
OUT=${OUT:-gpu_round4_out}
mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed: run scripts/gpu_wheels.sh here and carry .whl" | tee "$OUT/env.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
    date -u
    git log -1 --format='commit %H %s' 2>/dev/null || echo "commit: no git metadata travelled"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nproc; free -g | head -2; echo "ulimit -l: $(ulimit -l)"; df -h /dev/shm | tail -1
    python3 -c "import sys, torch, deepspeed, transformers, peft, hydra; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, \
'peft', peft.__version__, 'hydra', hydra.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 60 python3 -m bandpo.tools.gpu_smoke.ipc_probe \
    > "$OUT/ipc_probe.txt" 2>&1
echo "ipc probe rc=$? ($(($(date +%s) - t0)) s since start)" >> "$OUT/ipc_probe.txt"
grep -v -i warn "$OUT/ipc_probe.txt" | tail -6

GPU_TESTS=(
    tests/integration/actor/test_actor_gpu.py
    tests/integration/actor/test_offload_gpu.py
    tests/unit/weight_sync/test_checksums.py
    tests/unit/weight_sync/test_weight_sync.py
    tests/unit/actor/test_actor_packed.py
    tests/unit/actor/test_offload.py
    tests/unit/weight_sync/test_ipc_allocator.py
)
(
    timeout 420 python3 -m pytest -p no:cacheprovider -q -m gpu --timeout=150 -rA "${GPU_TESTS[@]}" \
        > "$OUT/gpu_tests.txt" 2>&1
    echo "tests rc=$?" >> "$OUT/gpu_tests.txt"
) &
tests=$!
DS_ACCELERATOR=cuda timeout 420 python3 -m bandpo.tools.gpu_smoke --out "$OUT/gpu_smoke.json" --workdir /tmp/smoke \
    > "$OUT/gpu_smoke.txt" 2>&1
echo "smoke rc=$? ($(($(date +%s) - t0)) s since start)" >> "$OUT/gpu_smoke.txt"
wait "$tests"
echo "all done in $(($(date +%s) - t0)) s" | tee -a "$OUT/env.txt"
grep -v -E "Warning|warnings.warn|return func|^\s*$" "$OUT/gpu_smoke.txt" | tail -30
tail -25 "$OUT/gpu_tests.txt"
