"""Benchmark: RL steps of TRL's GRPOTrainer on the tiny recipe's model, prompts and batch, for comparison with bandpo.

TRL is not a project dependency: install it beside the project venv, never into it, e.g.

    .venv/bin/python -m pip install --target /tmp/trl-site --no-deps trl accelerate
    PYTHONPATH=/tmp/trl-site .venv/bin/python -m benchmarks.trl_step [--steps 3] [--model-path DIR] \\
        [--out bench_trl.json]

(``--no-deps`` keeps pip from pulling another torch; TRL's other requirements are in .venv.)
bandpo's number for the same batch comes from ``benchmarks/step.py -- algorithm=grpo``.

One RL step here is what bandpo's tiny recipe (configs/model/tiny.yaml) does per step:
16 prompts of tiny_arith's train split (the DAPO template through the chat template, the
same token ids as bandpo's prompts), 32 samples each at temperature 1.0 and at most 48
new tokens, +1/-1 from bandpo's verifier (``bandpo.reward.RewardScorer``), group-normalised
advantages, old, reference and new log-probs, and 2 AdamW steps of 8 prompts (256 rows)
in micro-batches of 64 rows: TRL's per_device_train_batch_size=64,
gradient_accumulation_steps=4, steps_per_generation=8. The loss matches bandpo's grpo
algorithm: ratio clip 0.2 both sides, dual clip 10 (TRL's ``delta``), k3 KL at 0.001,
seq-mean-token-mean (TRL's ``loss_type="grpo"``); lr 2e-5 constant, weight decay 0.01,
grad-norm clip 1.0; float32 on CPU, or with ``--bf16`` TRL's own mixed precision (``bf16=True``:
fp32 weights and AdamW, the forward and backward under bf16 autocast). Each RL step's time is the sum of its optimizer steps'
on_step_begin -> on_step_end spans; step 1 is dropped as warm-up when there is more than
one. Printed (and written as JSON): median and mean s/step; median seconds of its stages
(generate: the ``model.generate`` call; reward: grading; other: old and reference log-probs,
forward/backward, optimizer steps); generated tokens per step (the completion ids the
reward function sees, EOS included, as in bandpo's vLLM token_ids); tokens/s over whole
steps and over generate alone; CPU seconds per step and the peak RSS of this process.

What still differs from bandpo (benchmarks/step.py):

- generation: transformers ``generate`` on all 512 rows in one padded batch, in the
  training process, vs vLLM-CPU in its own Ray worker (continuous batching, paged KV
  cache), whose weights bandpo syncs after each update (time/weight_sync);
- training: plain PyTorch AdamW through accelerate vs a DeepSpeed ZeRO-2 engine in a Ray
  actor; no Ray, no inter-process batches;
- bandpo's default tiny algorithm is bandpo (band ratio bounds); TRL has no band, so
  compare with ``algorithm=grpo`` (the loss is a negligible share of a step either way);
- TRL splits each step in two logged optimizer steps and shuffles prompts with its own
  sampler, so the 16 prompts of a step are not bandpo's 16; the reward workers run in
  this process's pool, not the trainer's;
- TRL adds 1e-4 to the group's reward std (bandpo 1e-6), which matters only for near-zero stds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

DEFAULT_MODEL = (
    Path(os.environ.get("BANDPO_CACHE", Path.home() / ".cache" / "bandpo")) / "tiny_arith" / "model"
)
INSTALL_HINT = (
    "TRL is not installed (it is not a bandpo dependency). Install it outside the project venv, e.g.\n"
    "  .venv/bin/python -m pip install --target /tmp/trl-site --no-deps trl accelerate\n"
    "and run with PYTHONPATH=/tmp/trl-site, or use a separate venv with trl installed."
)


def build_dataset(tokenizer, size: int, seed: int):
    """tiny_arith train prompts as TRL rows: ``prompt`` (rendered text) and ``answer`` (gold)."""
    from datasets import Dataset

    from bandpo.data.datasets import load_examples
    from bandpo.data.prompts import render_prompt_text

    examples = load_examples("tiny_arith", split="train", size=size, seed=seed)
    # Pre-rendered text: TRL tokenizes a plain prompt as is, giving bandpo's render_prompt ids.
    return Dataset.from_list(
        [
            {"prompt": render_prompt_text(tokenizer, ex.problem, "dapo"), "answer": ex.answer}
            for ex in examples
        ]
    )


def make_reward(scorer, tokens: list[int], seconds: list[float]):
    """TRL reward function grading with ``scorer``; appends each call's completion tokens and grading seconds."""

    def bandpo_verifier(prompts, completions, completion_ids, answer, **kwargs):
        t0 = time.perf_counter()
        rewards = [s.reward for s in scorer.score(completions, answer)]
        seconds.append(time.perf_counter() - t0)
        tokens.append(sum(len(ids) for ids in completion_ids))
        return rewards

    return bandpo_verifier


def timed(fn, seconds: list[float]):
    """``fn`` wrapped to append the wall seconds of each call to ``seconds``."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    return wrapper


def make_timer():
    """A TrainerCallback recording each optimizer step's wall and CPU spans and TRL's log lines."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._begin = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.wall.append(time.perf_counter() - self._begin[0])
            self.cpu.append(time.process_time() - self._begin[1])

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append({"step": state.global_step, **(logs or {})})

    return StepTimer()


def summarize(
    step_s: list[float], cpu_s: list[float], tokens: list[int], stages: dict[str, list[float]]
) -> dict:
    """Per-RL-step times and throughput, the first step dropped as warm-up when there is more than one.

    ``stages`` holds one time per RL step for each named stage; "other" is the rest of the step
    (old/reference log-probs, forward/backward, optimizer steps, TRL's bookkeeping). ``cpu_s``
    is this process's CPU time per step: well below threads x wall time means other load.
    """
    drop = 1 if len(step_s) > 1 else 0
    times, toks = step_s[drop:], tokens[drop:]
    stages = {**stages, "other": [t - sum(s[i] for s in stages.values()) for i, t in enumerate(step_s)]}
    return {
        "steps_measured": list(range(drop + 1, len(step_s) + 1)),
        "warmup_step_s": step_s[0] if drop else None,
        "step_s": step_s,
        "median_step_s": statistics.median(times),
        "mean_step_s": statistics.mean(times),
        "cpu_s": cpu_s,
        "median_cpu_s": statistics.median(cpu_s[drop:]),
        "stages_median_s": {name: statistics.median(s[drop:]) for name, s in stages.items()},
        "generated_tokens_per_step": statistics.mean(toks),
        "tokens_per_s": sum(toks) / sum(times),
        "generate_tokens_per_s": sum(toks) / sum(stages["generate"][drop:]),
    }


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="RL steps; step 1 is dropped as warm-up if > 1")
    ap.add_argument("--model-path", type=Path, default=DEFAULT_MODEL, help="Hugging Face model folder")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    ap.add_argument("--n", type=int, default=32, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=48, help="most new tokens per sample")
    ap.add_argument("--mini-batch-prompts", type=int, default=8, help="prompts per optimizer step")
    ap.add_argument("--micro-batch-size", type=int, default=64, help="rows per forward/backward")
    ap.add_argument("--train-size", type=int, default=2048, help="tiny_arith train prompts to draw from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="TRL's bf16 mixed precision (GRPOConfig bf16=True)")
    ap.add_argument("--out", default="bench_trl.json", help="JSON results file")
    args = ap.parse_args()
    if not (args.model_path / "config.json").is_file():
        ap.error(f"--model-path {args.model_path} has no config.json (build it with scripts/train.sh once)")
    rows_per_step, rows_per_update = args.prompts * args.n, args.mini_batch_prompts * args.n
    if args.steps < 1 or args.prompts % args.mini_batch_prompts or rows_per_update % args.micro_batch_size:
        ap.error(
            "need --steps >= 1, --prompts a multiple of --mini-batch-prompts, and "
            "--mini-batch-prompts x --n a multiple of --micro-batch-size"
        )
    # TRL checks the vLLM version at import although this benchmark never uses vLLM.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        sys.exit(f"bench_trl: {e}\n{INSTALL_HINT}")
    import torch
    import transformers
    from transformers import AutoTokenizer

    from bandpo.reward import RewardScheme, RewardScorer

    updates_per_step = args.prompts // args.mini_batch_prompts
    out_dir = tempfile.mkdtemp(prefix="bandpo-bench-trl-")
    config = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=args.bf16,
        seed=args.seed,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=args.steps * updates_per_step,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=rows_per_update // args.micro_batch_size,
        steps_per_generation=rows_per_step // args.micro_batch_size,
        num_generations=args.n,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        learning_rate=2e-5,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=0.001,
        epsilon=0.2,
        delta=10.0,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        use_vllm=False,
        model_init_kwargs={"dtype": torch.float32},
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    generated: list[int] = []
    stages: dict[str, list[float]] = {"generate": [], "reward": []}
    timer = make_timer()
    with RewardScorer(RewardScheme(correct=1.0, incorrect=-1.0), answer_format="dapo") as scorer:
        trainer = GRPOTrainer(
            model=str(args.model_path),
            args=config,
            reward_funcs=make_reward(scorer, generated, stages["reward"]),
            train_dataset=build_dataset(tokenizer, args.train_size, args.seed),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        # Without vLLM, TRL samples through the model's own generate (one call per RL step, on
        # the unwrapped model, which on one CPU process is trainer.model): an instance
        # attribute shadows the method, so each call is timed.
        trainer.model.generate = timed(trainer.model.generate, stages["generate"])
        trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)

    def per_rl_step(spans):
        return [sum(spans[i : i + updates_per_step]) for i in range(0, len(spans), updates_per_step)]

    step_s = per_rl_step(timer.wall)
    if not len(step_s) == len(generated) == len(stages["generate"]):
        sys.exit(
            f"bench_trl: expected one generate and one reward call per RL step, got {len(stages['generate'])} "
            f"and {len(generated)} for {len(step_s)} steps"
        )
    report = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "config": {
            "model": str(args.model_path),
            "prompts_per_step": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "mini_batch_prompts": args.mini_batch_prompts,
            "micro_batch_size": args.micro_batch_size,
            "optimizer_steps_per_rl_step": updates_per_step,
            "device": "cpu",
            "torch_threads": torch.get_num_threads(),
        },
        "machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "summary": summarize(step_s, per_rl_step(timer.cpu), generated, stages),
        # ru_maxrss is in KiB on Linux; the reward workers are separate processes, not counted.
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trl_logs": timer.logs,
    }
    print_report(report)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return report


def print_report(report: dict) -> None:
    c, s, v = report["config"], report["summary"], report["versions"]
    print(
        f"\nTRL {v['trl']} (transformers {v['transformers']}, torch {v['torch']})  model: {c['model']}\n"
        f"batch: {c['prompts_per_step']} prompts x n={c['n']}, max_tokens {c['max_tokens']}, "
        f"{c['optimizer_steps_per_rl_step']} optimizer steps of {c['mini_batch_prompts']} prompts, "
        f"micro-batch {c['micro_batch_size']}  CPUs: {report['machine']['cpus']}, "
        f"torch threads {c['torch_threads']}, load average {report['machine']['load_average_1m']:.1f}"
    )
    warm = s["warmup_step_s"]
    print(
        f"steps measured: {s['steps_measured']}"
        + (f" (step 1 = warm-up, {warm:.2f} s, dropped)" if warm else "")
    )
    print("\n| TRL GRPOTrainer | value |\n|---|---|")
    print(f"| step times, s | {', '.join(f'{t:.2f}' for t in s['step_s'])} |")
    print(f"| median s/step | {s['median_step_s']:.2f} |")
    print(f"| mean s/step | {s['mean_step_s']:.2f} |")
    print(f"| median CPU s/step (this process) | {s['median_cpu_s']:.2f} |")
    for name, t in s["stages_median_s"].items():
        print(f"| median {name} s | {t:.2f} |")
    print(f"| generated tokens per step | {s['generated_tokens_per_step']:.0f} |")
    print(f"| generated tokens/s (whole steps) | {s['tokens_per_s']:.1f} |")
    print(f"| generate tokens/s (generate only) | {s['generate_tokens_per_s']:.1f} |")
    print(f"| peak RSS, MiB | {report['peak_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
