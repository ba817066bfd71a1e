#!/usr/bin/env bash
# The BandPO paper's entropy claim at laptop scale: GRPO's clip removes the gradient of
# low-probability tokens, so (the paper says) its policy entropy collapses while BandPO keeps it.
# That needs a policy with entropy to lose, which the tiny default's warm start (~76% held-out) is not
# (~0.02-0.04 nats per token: recipes/tiny_arith/results.md). Here the model is warm-started for 500 steps (~17%
# held-out mean@32, ~0.28 nats per token on the training prompts: model-sft500 in the tiny cache, the
# e2e tests' build); the rest is the tiny default without dynamic sampling (equal generation budgets):
# rollouts at temperature 1, 64 prompts x 8 samples a step, 4 optimizer steps per rollout at lr 1e-4
# (GRPO's clip binds on 1-4% of the tokens below p = 0.1), 50 steps. results-entropy.md lists the
# other settings tried and what they showed.
#
#   studies/compare/entropy.sh            # 3 seeds of the four main arms, one seed of the others,
#                                                    # then the length check (~50 min on 2 idle cores)
#   studies/compare/entropy.sh --quick    # one seed of the four main arms (~10 min on 2 idle cores)
#   studies/compare/entropy.sh [--quick] [extra Hydra overrides for every run...]
#
# Environment: RUNS (default runs/entropy, or runs/entropy-quick), RESULTS (the report; default
# studies/compare/results-entropy.md, or $RUNS/results.md with --quick), READING (a markdown
# file put in the report as its Reading), TRAIN (the launcher, as for compare.sh). Finished runs are
# skipped on a rerun (compare.sh). The four main arms: GRPO, Clip-Higher, BandPO (KL, delta 0.05),
# DPPO (TV mask); the one-seed arms: GSPO, CISPO, BandPO (TV, delta 0.1). Each seed's first arm (GRPO)
# evaluates the starting model; the others share that evaluation (SHARED_BEFORE in compare.sh). The
# length check: GRPO and BandPO, seed 0, for LONG_STEPS (150) steps into $RUNS/long (its own report
# there): does GRPO's entropy keep falling, and does BandPO's follow it, beyond the matrix's length?
set -euo pipefail
cd "$(dirname "$0")/../.."
QUICK=0 FLAG=""
if [[ ${1:-} == --quick ]]; then QUICK=1 FLAG="--quick "; shift; fi

# The matrix's model and pool as recorded: the 500-step warm start on the whole train split, RL on its first
# 2,048 problems (the tiny default now splits the training problems between the two).
SETTING=(model.build_args.sft_steps=500 model.build_args.max_steps=null model.build_args.part=null
         model.build_args.n_sft=2500 data=tiny_arith
         algorithm.filter_groups.enable=false trainer.prompts_per_step=64
         actor.mini_batch_prompts=16 actor.lr=1e-4 trainer.save_every=10 trainer.export_hf=false
         trainer.wandb.mode=disabled)
MAIN="grpo clip_higher bandpo dppo_tv"
ONE_SEED="gspo cispo bandpo_tv"
export STEPS=${STEPS:-50} SHARED_BEFORE=1
LONG_STEPS=${LONG_STEPS:-150}
if ((QUICK)); then
  export RUNS=${RUNS:-runs/entropy-quick}
  RESULTS=${RESULTS:-$RUNS/results.md}
  plan=("$MAIN|0")
else
  export RUNS=${RUNS:-runs/entropy}
  RESULTS=${RESULTS:-studies/compare/results-entropy.md}
  plan=("$MAIN|0 1 2" "$ONE_SEED|0")
fi

commands=("studies/compare/entropy.sh $FLAG$*"
          "# = STEPS=$STEPS SHARED_BEFORE=1 RUNS=$RUNS studies/compare/compare.sh ${SETTING[*]} $*, with")
status=0
for entry in "${plan[@]}"; do
  algos=${entry%|*} seeds=${entry#*|}
  commands+=("#   ALGOS=\"$algos\" SEEDS=\"$seeds\"")
  # compare.sh's own summary of each part goes beside the runs; the report below covers all parts.
  ALGOS=$algos SEEDS=$seeds RESULTS=$RUNS/partial.md studies/compare/compare.sh "${SETTING[@]}" "$@" || status=1
done
if ((!QUICK)); then
  commands+=("# the length check: STEPS=$LONG_STEPS ALGOS=\"grpo bandpo\" SEEDS=0 RUNS=$RUNS/long (report: $RUNS/long/results.md)")
  STEPS=$LONG_STEPS ALGOS="grpo bandpo" SEEDS=0 RUNS=$RUNS/long RESULTS=$RUNS/long/results.md \
    studies/compare/compare.sh "${SETTING[@]}" "$@" || status=1
fi

report=(--runs "$RUNS" --out "$RESULTS" --headline --title "tiny_arith: does BandPO keep the entropy GRPO loses?")
for c in "${commands[@]}"; do report+=(--command "$c"); done
if [[ -n ${READING:-} ]]; then report+=(--reading "$READING"); fi
.venv/bin/python -m studies.compare.report "${report[@]}"
exit $status
