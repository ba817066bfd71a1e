"""The trainer's random reward (trainer.reward.random_p) where stage 3 makes the batch's rewards: the
draw replaces the graded reward whatever the answer, dynamic sampling filters on it, the scores keep the
grading, and ``reward/random_frac_positive`` is logged. Stand-ins for the engines and the verifier."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from bandpo.config import compose
from bandpo.reward import Score
from bandpo.reward.scheme import random_positive
from bandpo.trainer.dynamic_sampling import BatchDrawer
from bandpo.types import RolloutBatch

N_SAMPLES, PROMPTS, R = 4, 2, 3  # rollout.n, prompts per round, response positions


class Sampler:
    def __init__(self):
        self.next = 0

    def next_batch(self, k):
        self.next += k
        return list(range(self.next - k, self.next))


class Engines:
    def generate(self, prompts, params):
        n = len(prompts) * params.n
        return RolloutBatch(
            prompt_ids=torch.ones(n, 2, dtype=torch.long),
            prompt_mask=torch.ones(n, 2, dtype=torch.long),
            response_ids=torch.ones(n, R, dtype=torch.long),
            response_mask=torch.ones(n, R, dtype=torch.long),
            rollout_logprobs=torch.zeros(n, R),
            prompt_index=torch.arange(len(prompts)).repeat_interleave(params.n),
            finish_reasons=["stop"] * n,
        )


class Grader:
    """Grades every response ``correct`` (or every one ``incorrect``): the reward the scheme would give."""

    def __init__(self, correct: bool):
        self.correct = correct

    def score(self, texts, gold, lengths):
        status = "correct" if self.correct else "incorrect"
        return [Score(1.0 if self.correct else 0.0, status, "x", self.correct) for _ in texts]


class Tokenizer:
    def batch_decode(self, responses, skip_special_tokens):
        return ["x"] * len(responses)


def _drawer(correct: bool, *overrides: str) -> BatchDrawer:
    cfg = compose(
        [
            f"rollout.n={N_SAMPLES}",
            f"trainer.prompts_per_step={PROMPTS}",
            "actor.mini_batch_prompts=1",
            "actor.micro_batch_size=2",
            "trainer.seed=5",
            "trainer.reward.incorrect=0.0",
            "trainer.reward.random_p=0.5",
            *overrides,
        ]
    )
    prompts, answers = [[1, 2]] * 100, ["1"] * 100
    return BatchDrawer(
        cfg, Sampler(), prompts, answers, Engines(), Grader(correct), Tokenizer(), lambda name: nullcontext()
    )


def test_the_reward_is_the_draw_whatever_the_answer():
    step = 3
    expected = [1.0 if h else 0.0 for h in random_positive(PROMPTS * N_SAMPLES, 0.5, 5, step, 0)]
    for correct in (True, False):
        drawn = _drawer(correct, "algorithm.filter_groups.enable=false").draw(step)
        assert drawn.round.batch.rewards.tolist() == expected
        assert all(s.correct is correct for s in drawn.scores)  # reward/accuracy stays the grading's
        assert drawn.metrics == {"reward/random_frac_positive": sum(expected) / len(expected)}


def test_dynamic_sampling_filters_on_the_random_reward():
    # Every response is graded correct, so on the grading every group is equal and none would be kept;
    # on the draw a group of 4 fair coins is equal with probability 1/8
    step = 2
    drawer = _drawer(True, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_gen_rounds=3")
    drawn = drawer.draw(step)
    kept, hits = [], []
    for r in range(drawn.metrics["filter/rounds"]):
        flags = random_positive(PROMPTS * N_SAMPLES, 0.5, 5, step, r)
        hits += flags
        groups = [flags[g * N_SAMPLES : (g + 1) * N_SAMPLES] for g in range(PROMPTS)]
        kept += [[1.0 if h else 0.0 for h in grp] for grp in groups if len(set(grp)) > 1]
    assert kept, "no varying group in the draw: pick another seed"
    trained = drawn.round.batch.rewards.view(-1, N_SAMPLES).tolist()
    assert trained == kept[: len(trained)] and len(trained) == min(len(kept), PROMPTS)
    assert drawn.metrics["reward/random_frac_positive"] == sum(hits) / len(hits)
    assert all(s.correct for s in drawn.scores)
