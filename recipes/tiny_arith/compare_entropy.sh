#!/usr/bin/env bash
# The BandPO paper's entropy claim at laptop scale: GRPO's clip removes the gradient of
# low-probability tokens, so (the paper says) its policy entropy collapses while BandPO keeps it.
# That needs a policy with entropy to lose, which the tiny default's 1,500-step warm start is not
# (~0.02-0.04 nats per token: results.md). Here the model is warm-started for 500 steps (~20%
# held-out at T=1, ~0.25 nats per token: model-sft500 in the tiny cache, the e2e tests' build),
# rollouts at temperature 1, 32 prompts x 8 samples a step for 20 steps, and 4 optimizer steps per
# rollout at lr 3e-4 so that the clip binds (results-entropy.md: the settings tried and what they showed).
#
#   recipes/tiny_arith/compare_entropy.sh            # 3 seeds of the four main arms, one seed of the others
#   recipes/tiny_arith/compare_entropy.sh --quick    # one seed of the four main arms (< 30 min on 2 idle cores)
#   recipes/tiny_arith/compare_entropy.sh [--quick] [extra Hydra overrides for every run...]
#
# Environment: RUNS (default runs/entropy, or runs/entropy-quick), RESULTS (the report; default
# recipes/tiny_arith/results-entropy.md, or $RUNS/results.md with --quick), READING (a markdown
# file put in the report as its Reading), TRAIN (the launcher, as for compare.sh). Finished runs are
# skipped on a rerun (compare.sh). The four main arms: GRPO, Clip-Higher, BandPO (KL, delta 0.05),
# DPPO (TV mask); the one-seed arms: GSPO, CISPO, BandPO (TV, delta 0.1). Each seed's first arm (GRPO)
# evaluates the starting model; the others share that evaluation (SHARED_BEFORE in compare.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
QUICK=0 FLAG=""
if [[ ${1:-} == --quick ]]; then QUICK=1 FLAG="--quick "; shift; fi

SETTING=(model.build_args.sft_steps=500 algorithm.filter_groups.enable=false trainer.prompts_per_step=32
         actor.mini_batch_prompts=8 actor.lr=3e-4 trainer.save_every=5 trainer.export_hf=false
         trainer.wandb.mode=disabled)
MAIN="grpo clip_higher bandpo dppo_tv"
ONE_SEED="gspo cispo bandpo_tv"
export STEPS=${STEPS:-20} SHARED_BEFORE=1
if ((QUICK)); then
  export RUNS=${RUNS:-runs/entropy-quick}
  RESULTS=${RESULTS:-$RUNS/results.md}
  plan=("$MAIN|0")
else
  export RUNS=${RUNS:-runs/entropy}
  RESULTS=${RESULTS:-recipes/tiny_arith/results-entropy.md}
  plan=("$MAIN|0 1 2" "$ONE_SEED|0")
fi

commands=("recipes/tiny_arith/compare_entropy.sh $FLAG$*"
          "# = STEPS=$STEPS SHARED_BEFORE=1 RUNS=$RUNS recipes/tiny_arith/compare.sh ${SETTING[*]} $*, with")
status=0
for entry in "${plan[@]}"; do
  algos=${entry%|*} seeds=${entry#*|}
  commands+=("#   ALGOS=\"$algos\" SEEDS=\"$seeds\"")
  # compare.sh's own summary of each part goes beside the runs; the report below covers all parts.
  ALGOS=$algos SEEDS=$seeds RESULTS=$RUNS/partial.md recipes/tiny_arith/compare.sh "${SETTING[@]}" "$@" || status=1
done

report=(--runs "$RUNS" --out "$RESULTS" --headline --title "tiny_arith: does BandPO keep the entropy GRPO loses?")
for c in "${commands[@]}"; do report+=(--command "$c"); done
if [[ -n ${READING:-} ]]; then report+=(--reading "$READING"); fi
.venv/bin/python recipes/tiny_arith/compare.py "${report[@]}"
exit $status
