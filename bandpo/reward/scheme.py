"""From a grading status to a scalar reward, and the reward metrics the trainer logs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RewardScheme:
    """How a graded response becomes a reward.

    Attributes:
        correct: reward of a correct answer (paper: +1).
        incorrect: reward of a wrong answer, and of ``timeout``/``error``/``invalid_input``
            (paper: -1; 0 is the other common choice).
        format_penalty: reward when no answer could be extracted (``no_answer``);
            None means the same as ``incorrect``.
        overlong_buffer: DAPO overlong shaping. With ``L = max_response_len`` and
            ``B = overlong_buffer > 0``, a response of ``l > L - B`` tokens gets
            ``-overlong_penalty * (l - (L - B)) / B`` added (so ``-overlong_penalty`` at
            ``l = L``). 0 turns shaping off.
        overlong_penalty: the penalty factor at the full buffer (DAPO: 1.0).
        max_response_len: the rollout's response token limit; required for shaping.
    """

    correct: float = 1.0
    incorrect: float = -1.0
    format_penalty: float | None = None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_response_len: int | None = None

    def __post_init__(self):
        if self.overlong_buffer < 0:
            raise ValueError(f"RewardScheme.overlong_buffer must be >= 0, got {self.overlong_buffer}")
        if self.overlong_buffer > 0 and (
            self.max_response_len is None or self.max_response_len <= self.overlong_buffer
        ):
            raise ValueError(
                "RewardScheme.overlong_buffer > 0 needs max_response_len > overlong_buffer, got "
                f"max_response_len={self.max_response_len}, overlong_buffer={self.overlong_buffer}"
            )

    @property
    def shapes_length(self) -> bool:
        """Whether rewards depend on the response length (then lengths must be given)."""
        return self.overlong_buffer > 0

    def reward(self, status: str, response_len: int | None = None) -> float:
        """Reward of one response with the given grading status and token length."""
        if status == "correct":
            value = self.correct
        elif status == "no_answer" and self.format_penalty is not None:
            value = self.format_penalty
        else:
            value = self.incorrect
        if self.shapes_length and response_len is not None:
            exceed = response_len - (self.max_response_len - self.overlong_buffer)
            value += min(-exceed / self.overlong_buffer * self.overlong_penalty, 0.0)
        return float(value)


def check_random_p(p: float | None, name: str = "random_p") -> float | None:
    """The random reward's probability: None (off) or a number strictly between 0 and 1 (at 0 or 1 every
    group's rewards would be equal: no advantage anywhere)."""
    if p is None:
        return None
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p < 1:
        raise ValueError(f"{name} must be null or a number strictly between 0 and 1, got {p!r}")
    return float(p)


def random_positive(n: int, p: float, seed: int, step: int, round_: int = 0) -> list[bool]:
    """Which of a round's ``n`` responses the random reward calls correct: row i's Bernoulli(``p``)
    draw is the i-th uniform of a generator seeded by (``seed``, ``step``, ``round_``) alone, so it
    does not see the response, and a resumed run (or a replayed round) draws the same."""
    check_random_p(p)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # SeedSequence takes non-negative words: a negative seed wraps to its 64-bit two's complement
    rng = np.random.default_rng([v % (1 << 64) for v in (seed, step, round_)])
    return (rng.random(n) < p).tolist()


def random_rewards(
    n: int,
    p: float,
    seed: int,
    step: int,
    scheme: RewardScheme,
    response_lengths: Sequence[int] | None = None,
    round_: int = 0,
) -> list[float]:
    """A diagnostic reward independent of the answer: each of the ``n`` responses gets ``scheme``'s
    ``correct`` with probability ``p``, else its ``incorrect`` (``random_positive`` draws which), and the
    scheme's overlong shaping on top when it is on (``response_lengths`` then needed)."""
    if scheme.shapes_length and response_lengths is None:
        raise ValueError("the reward scheme uses overlong shaping: pass response_lengths")
    if response_lengths is not None and len(response_lengths) != n:
        raise ValueError(f"{n} responses but {len(response_lengths)} response_lengths")
    lengths = response_lengths if response_lengths is not None else [None] * n
    drawn = random_positive(n, p, seed, step, round_)
    return [scheme.reward("correct" if hit else "incorrect", ln) for hit, ln in zip(drawn, lengths)]


def check_score_inputs(
    scheme: RewardScheme, responses: Sequence, answers: Sequence, response_lengths: Sequence[int] | None
) -> int:
    """The batch size; ValueError when the sequences' lengths differ or the scheme's overlong
    shaping has no ``response_lengths`` (every scorer's contract, in-process or Ray)."""
    n = len(responses)
    if len(answers) != n:
        raise ValueError(f"{n} responses but {len(answers)} answers")
    if response_lengths is not None and len(response_lengths) != n:
        raise ValueError(f"{n} responses but {len(response_lengths)} response_lengths")
    if scheme.shapes_length and response_lengths is None:
        raise ValueError("the reward scheme uses overlong shaping: pass response_lengths")
    return n


@dataclass
class Score:
    """The grading of one response.

    Attributes:
        reward: the scalar reward under the scorer's ``RewardScheme``.
        status: one of ``correct``, ``incorrect``, ``no_answer``, ``timeout``, ``error``,
            ``invalid_input``.
        extracted: the answer string taken from the response, or None.
        correct: ``status == "correct"``.
        seconds: time spent grading this item in its worker (the timeout for ``timeout``).
    """

    reward: float
    status: str
    extracted: str | None
    correct: bool
    seconds: float = 0.0


def reward_metrics(scores: list[Score]) -> dict[str, float]:
    """A step's reward metrics: ``reward/mean``, ``reward/accuracy`` and ``reward/frac_<status>`` for
    every status that occurred (fractions of all graded responses)."""
    n = max(len(scores), 1)
    counts = Counter(s.status for s in scores)
    out = {
        "reward/mean": sum(s.reward for s in scores) / n,
        "reward/accuracy": sum(s.correct for s in scores) / n,
    }
    out.update({f"reward/frac_{status}": c / n for status, c in counts.items()})
    return out
