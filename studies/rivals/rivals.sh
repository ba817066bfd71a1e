#!/usr/bin/env bash
# Band against its rivals on the real pretrained model: GRPO, Clip-Higher, BandPO (KL, the paper's
# delta 0.05), DPPO-TV and DCPO on SmolLM2-135M-Instruct's arithmetic (the smollm2_arith recipe), 3
# seeds each, equal budgets: only the algorithm and the seed differ. Per step the runs log entropy,
# the clipped (or masked) fraction by old-probability bin (and by sign of the advantage: runs recorded
# before the split have it without) and response length; before and after, held-out mean@8, maj@8
# and pass@8.
#
#   studies/rivals/rivals.sh            # 5 arms x 3 seeds (~4 h on 2 idle cores)
#   studies/rivals/rivals.sh --quick    # 5 arms x seed 0, one step each, 16 held-out problems (~30 min)
#   studies/rivals/rivals.sh [--quick] [extra Hydra overrides for every run...]
#
# Resumable: a finished run is skipped, an interrupted one resumes from its last checkpoint (every
# step: trainer.save_every=1), through studies/compare/compare.sh. Each finished run's numbers are
# kept in studies/rivals/records/ (RECORD; committed with the report): a clone that has them
# runs only the rest, so the ~4 hours may be spread over machines. Each seed's first arm (GRPO)
# evaluates the starting model and the others share it (SHARED_BEFORE). Environment: RUNS (default
# runs/smollm2_rivals, or runs/smollm2_rivals-quick), RESULTS (default
# studies/rivals/results-rivals.md, or $RUNS/results.md with --quick), READING (a markdown file
# put in the report as its Reading), SEEDS, STEPS.
#
# The budget, and why (recipes/smollm2_arith/default.md has the recipe's own numbers): the recipe's
# 10 steps at lr 1e-5 move the policy so little that Band clips ~0.01% of the tokens and every
# algorithm computes the same gradient. Here each rollout feeds 3 optimizer steps (mini-batches of 2
# of its 6 prompts) at lr 3e-5, so later mini-batches are off-policy enough for the clips to differ;
# 6 prompts x 8 samples x 160 tokens and 3 steps keep 15 runs and their evaluations (48 held-out
# problems x 8 samples) within ~4 hours of a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
QUICK=0 FLAG=""
if [[ ${1:-} == --quick ]]; then QUICK=1 FLAG="--quick "; shift; fi

# keep_last=1: a checkpoint (the full model and its Adam state) is ~2 GB, and keeping the trainer's
# default 3 in each of 15 runs would take ~90 GB; a resume needs only the latest, written atomically.
SETTING=(trainer.prompts_per_step=6 rollout.n=8 rollout.max_tokens=160 actor.mini_batch_prompts=2
         actor.lr=3e-5 eval.max_tokens=160 trainer.save_every=1 trainer.keep_last=1 trainer.export_hf=false
         trainer.wandb.mode=disabled)
export ALGOS="grpo clip_higher bandpo dppo_tv dcpo" SHARED_BEFORE=1
if ((QUICK)); then
  export SEEDS=0 STEPS=${STEPS:-1} RUNS=${RUNS:-runs/smollm2_rivals-quick}
  export RESULTS=${RESULTS:-$RUNS/results.md}
  SETTING+=(eval.limit=16)
else
  export SEEDS=${SEEDS:-0 1 2} STEPS=${STEPS:-3} RUNS=${RUNS:-runs/smollm2_rivals}
  export RESULTS=${RESULTS:-studies/rivals/results-rivals.md}
  export RECORD=${RECORD:-studies/rivals/records}
  SETTING+=(eval.limit=48)
fi
export TITLE="smollm2_arith: GRPO, Clip-Higher, BandPO, DPPO-TV and DCPO on SmolLM2-135M-Instruct"
status=0
# compare.sh's own summary goes beside the runs; the report below adds the headline figure.
RESULTS=$RUNS/partial.md bash recipes/smollm2_arith/run.sh "${SETTING[@]}" "$@" || status=1

report=(--runs "$RUNS" --out "$RESULTS" --headline --title "$TITLE"
        --command "studies/rivals/rivals.sh $FLAG$*"
        --command "# = ALGOS=\"$ALGOS\" SEEDS=\"$SEEDS\" STEPS=$STEPS SHARED_BEFORE=1 RUNS=$RUNS recipes/smollm2_arith/run.sh ${SETTING[*]} $*")
if [[ -n ${READING:-} ]]; then report+=(--reading "$READING"); fi
.venv/bin/python -m studies.compare.report "${report[@]}"
exit $status
