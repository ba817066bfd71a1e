#!/usr/bin/env bash
# Stage 0 of the entropy test (studies/entropy/stage0.py has the method): 3 states of
# SmolLM2-135M-Instruct (the base model and two checkpoints of a GRPO run at the stage's own settings)
# x 6 rollout batches; from each state and batch one GRPO and one BandPO (KL, delta 0.05) update from
# the same weights and optimizer state; the probe entropy before and after each; the report's Stage 0
# section in studies/entropy/results-entropy.md.
#
#   studies/entropy/stage0.sh           # the GRPO run to step 20, 18 trials, the report
#   studies/entropy/stage0.sh --quick   # base x 2 batches, small batches and probe (no GRPO run)
#   studies/entropy/stage0.sh [--quick] [extra Hydra overrides for the run and the trials...]
#   STATE_STEPS="5 10" BATCHES=4 studies/entropy/stage0.sh
#
# Resumable in each of its three parts. The GRPO run (scripts/train.sh into $RUNS/grpo, no evaluation)
# resumes from its last checkpoint (every SAVE_EVERY steps, all kept: each is a state) and is skipped
# once the last state's checkpoint exists (if its folder is gone once recorded, the script stops); its
# metrics.jsonl and config.yaml are copied into the records (grpo-run/). Each trial is written to
# studies/entropy/records/stage0/<state>-b<batch>.json (committed with the report) as it ends
# and is never run again, so a clone with the records runs only the rest. The report is rebuilt from the
# records alone (python -m studies.entropy.stage0 --report).
# Environment: RUNS (default runs/entropy_stage0), STATE_STEPS (default "10 20"), SAVE_EVERY (5),
# BATCHES (6), RECORDS (default studies/entropy/records/stage0), RESULTS (the report, default
# studies/entropy/results-entropy.md: its Stage 0 section is rewritten, the rest kept).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=studies.entropy.stage0
if [[ ${1:-} == --quick ]]; then
  shift
  exec .venv/bin/python -m "$PY" --quick "$@"
fi
RUNS=${RUNS:-runs/entropy_stage0} STATE_STEPS=${STATE_STEPS:-10 20} SAVE_EVERY=${SAVE_EVERY:-5}
BATCHES=${BATCHES:-6} RECORDS=${RECORDS:-studies/entropy/records/stage0}
RESULTS=${RESULTS:-studies/entropy/results-entropy.md}
mapfile -t SETTING < <(.venv/bin/python -m "$PY" --print-setting)

read -ra steps <<< "$STATE_STEPS"
last=0
states="base=base"
for s in "${steps[@]}"; do
  if ((s % SAVE_EVERY)); then
    echo "stage0.sh: STATE_STEPS holds $s, not a multiple of SAVE_EVERY=$SAVE_EVERY" >&2
    exit 2
  fi
  if ((s > last)); then last=$s; fi
  states+=",grpo$s=$RUNS/grpo/checkpoints/step_$(printf %06d "$s")"
done

if [[ ! -d $RUNS/grpo/checkpoints/step_$(printf %06d "$last") ]]; then
  # Trials were recorded from this run's states: trained again it would be another run (float rounding
  # flips a sampled token within a few steps), and the states' remaining trials would measure its states.
  if [[ -d $RECORDS/grpo-run && ! -f $RUNS/grpo/metrics.jsonl ]]; then
    echo "stage0.sh: $RUNS/grpo is gone, but $RECORDS/grpo-run records it and trials were taken from" \
      "its states; restore the folder, or remove $RECORDS to start stage 0 over" >&2
    exit 2
  fi
  mkdir -p "$RUNS/grpo"
  bash scripts/train.sh "${SETTING[@]}" algorithm=grpo "trainer.total_steps=$last" \
    "trainer.save_every=$SAVE_EVERY" "trainer.keep_last=$((last / SAVE_EVERY))" "trainer.output_dir=$RUNS/grpo" \
    trainer.eval_before_train=false trainer.eval_every=0 trainer.export_hf=false trainer.wandb.mode=disabled \
    "$@" 2>&1 | tee -a "$RUNS/grpo/train.log"
fi
mkdir -p "$RECORDS/grpo-run"
cp "$RUNS/grpo/metrics.jsonl" "$RUNS/grpo/config.yaml" "$RECORDS/grpo-run/"

.venv/bin/python -m "$PY" --states "$states" --batches "$BATCHES" --records "$RECORDS" --out "$RESULTS" "$@"
