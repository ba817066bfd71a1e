#!/bin/bash
# the GPU round: smoke test (with LoRA), the gpu-marked tests, the host CPU's matmul peaks and an actor profile there
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket"; grep -o -w -E "amx_[a-z0-9]+|avx512_bf16|avx512f" /proc/cpuinfo | sort | uniq -c
  python3 -c "import torch, deepspeed, transformers, peft, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
DS_ACCELERATOR=cuda timeout 290 python3 scripts/gpu_smoke.py --out $OUT/gpu_smoke.json --workdir /tmp/smoke > $OUT/gpu_smoke.txt 2>&1
echo "smoke rc=$?" >> $OUT/gpu_smoke.txt
grep -v -E "Warning|warnings.warn|return func|^\s*$" $OUT/gpu_smoke.txt | tail -45
timeout 90 python3 -m pytest -p no:cacheprovider -q -m gpu --timeout=85 tests/integration/actor/test_actor_gpu.py tests/integration/actor/test_offload_gpu.py tests/unit/weight_sync/test_checksums.py tests/unit/weight_sync/test_weight_sync.py tests/unit/actor/test_actor_packed.py tests/unit/actor/test_offload.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$?" >> $OUT/gpu_tests.txt; tail -15 $OUT/gpu_tests.txt
timeout 40 python3 - > $OUT/cpu_mm.txt 2>&1 <<'PY'
import torch, time
for threads in (2, 16):
    torch.set_num_threads(threads)
    for dt in (torch.float32, torch.bfloat16):
        for m, k, n in ((2048, 576, 1536), (2048, 1536, 576), (2048, 2048, 2048)):
            a = torch.randn(m, k, dtype=dt); b = torch.randn(k, n, dtype=dt)
            for _ in range(3): a @ b
            reps = 20; t = time.perf_counter()
            for _ in range(reps): a @ b
            s = (time.perf_counter() - t) / reps
            print(f"host CPU torch.mm [{m},{k}]x[{k},{n}] threads={threads} {str(dt)[6:]}: {2*m*k*n/s/1e9:.0f} GFLOP/s")
PY
cat $OUT/cpu_mm.txt
CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu timeout 150 python3 scripts/profile_actor.py --random-shape smollm2 --threads 16 --bf16 both --out $OUT/profile_amx.json > $OUT/profile_amx.txt 2>&1
echo "profile rc=$?" >> $OUT/profile_amx.txt
grep -v -i warn $OUT/profile_amx.txt | tail -12
