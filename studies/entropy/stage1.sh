#!/usr/bin/env bash
# Stage 1 of the entropy test (studies/entropy/stage1.py has the method): a GRPO pilot of
# 30 steps at stage 0's settings on an easier mix, a checkpoint every 5 steps (all kept), then stage 0's
# probe at steps 0, 5, ..., 30; the report's Stage 1 section in studies/entropy/results-entropy.md.
#
#   studies/entropy/stage1.sh [extra Hydra overrides for the run and the probes...]
#
# Resumable in both parts: the run (scripts/train.sh into $RUNS/grpo, no evaluation) resumes from its
# last checkpoint and is skipped once step 30's exists; its metrics.jsonl and config.yaml are copied into
# the records (run/). Each probe is written to studies/entropy/records/stage1/probe-step_N.json
# as it ends and is never run again. The report is rebuilt from the records (python -m studies.entropy.stage1 --report).
# Environment: RUNS (default runs/entropy_stage1), RECORDS (default studies/entropy/records/
# stage1), RESULTS (default studies/entropy/results-entropy.md: its Stage 1 section is rewritten).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=studies.entropy.stage1
RUNS=${RUNS:-runs/entropy_stage1} RECORDS=${RECORDS:-studies/entropy/records/stage1}
RESULTS=${RESULTS:-studies/entropy/results-entropy.md}
mapfile -t SETTING < <(.venv/bin/python -m "$PY" --print-setting)

# Recorded once, when the run has reached step 30: stage 2 continues this run to step 60 and prunes its
# checkpoints, which must not send it back here.
if [[ ! -f $RECORDS/run/metrics.jsonl ]]; then
  if [[ ! -d $RUNS/grpo/checkpoints/step_000030 ]]; then
    mkdir -p "$RUNS/grpo"
    bash scripts/train.sh "${SETTING[@]}" algorithm=grpo trainer.total_steps=30 trainer.save_every=5 \
      trainer.keep_last=6 "trainer.output_dir=$RUNS/grpo" trainer.eval_before_train=false trainer.eval_every=0 \
      trainer.export_hf=false trainer.wandb.mode=disabled "$@" 2>&1 | tee -a "$RUNS/grpo/train.log"
  fi
  mkdir -p "$RECORDS/run"
  cp "$RUNS/grpo/metrics.jsonl" "$RUNS/grpo/config.yaml" "$RECORDS/run/"
fi

.venv/bin/python -m "$PY" --run "$RUNS/grpo" --records "$RECORDS" --out "$RESULTS" "$@"
