#!/usr/bin/env bash
# Stage 2 of the entropy test (studies/entropy/stage2.py has the method): GRPO against
# BandPO, 3 seeds x 60 steps at stage 1's settings, GRPO's seed 0 being stage 1's pilot continued; each
# run's checkpoints probed every 5 steps and evaluated at 30 and 60, then removed but the last; the report's
# Stage 2 section in studies/entropy/results-entropy.md. It refuses to start unless stage 1's rule
# let it (GRPO's probe entropy fell to <= 60% of its start).
#
#   studies/entropy/stage2.sh [extra Hydra overrides for the runs and the probes...]
#
# Resumable: a run resumes from its last checkpoint; a probe or an evaluation recorded in
# studies/entropy/records/stage2/ is never made again. A run with records whose folder is
# gone stops the script (trained again it would be another run): keep RUNS until a run is evaluated.
# ~2.5 h a run on 2 cores (fp32), six runs.
# Once the records fix the verdict (a GRPO seed short of the collapse at step 60), a seed not begun is not
# started; --all-seeds runs every seed anyway.
# Environment: RUNS (default runs/entropy_stage2), PILOT (stage 1's run, default runs/entropy_stage1/grpo),
# STAGE1_RECORDS, RECORDS (default studies/entropy/records/stage1 and .../stage2), RESULTS.
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ -x .venv/bin/python ]] || bash scripts/setup.sh
exec .venv/bin/python -m studies.entropy.stage2 \
  --runs "${RUNS:-runs/entropy_stage2}" --pilot "${PILOT:-runs/entropy_stage1/grpo}" \
  --stage1-records "${STAGE1_RECORDS:-studies/entropy/records/stage1}" \
  --records "${RECORDS:-studies/entropy/records/stage2}" \
  --out "${RESULTS:-studies/entropy/results-entropy.md}" "$@"
