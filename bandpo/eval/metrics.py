"""Evaluation metrics over n sampled responses per problem. Pure Python + numpy.

Definitions (P problems, n samples each, c_i of them correct for problem i):

- ``mean@n``  = (1/P) sum_i c_i / n: the mean accuracy over all P*n samples (the paper's
  "mean@32", a.k.a. avg@n). An estimate of pass@1, NOT the chance that any sample is right.
- ``std``     = population standard deviation (ddof=0) over problems of c_i / n.
- ``pass@k``  = (1/P) sum_i [1 - C(n - c_i, k) / C(n, k)]: the unbiased estimator of the chance
  that at least one of k samples is correct (Chen et al., 2021), for k <= n.
- ``maj@n``   = fraction of problems whose majority-vote answer is correct (see ``majority_vote``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct among ``n`` samples.

    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i): no big binomials,
    stable for n in the thousands.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def default_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, with n itself always last."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def mean_at_n(correct: Sequence[Sequence[bool]]) -> float:
    """Mean accuracy over all samples of all problems (each problem weighted by its sample count)."""
    total = sum(len(row) for row in correct)
    if total == 0:
        raise ValueError("mean_at_n: no samples")
    return sum(sum(bool(x) for x in row) for row in correct) / total


def per_problem_accuracy(correct: Sequence[Sequence[bool]]) -> np.ndarray:
    """[P] fraction of correct samples per problem."""
    return np.array([np.mean([bool(x) for x in row]) if len(row) else 0.0 for row in correct], dtype=float)


def majority_vote(answers: Sequence[Hashable | None]) -> tuple[Hashable | None, int]:
    """The most frequent non-empty answer and its count.

    ``None`` and "" (no extracted answer) do not vote. Ties go to the answer that appears
    first in sample order, so the result is a function of the inputs alone. Returns
    ``(None, 0)`` when no sample produced an answer.
    """
    votes = [a for a in answers if a is not None and a != ""]
    if not votes:
        return None, 0
    counts = Counter(votes)
    best = max(counts.values())
    winner = next(a for a in votes if counts[a] == best)  # first to reach the top count in sample order
    return winner, best


def maj_correct(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> bool:
    """True when the majority-vote answer is correct.

    The winning answer counts as correct when any sample that gave exactly that answer was
    judged correct (they share one extracted answer; a verifier timeout on one of them
    should not flip the vote). No extracted answer at all counts as incorrect.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_correct: {len(answers)} answers but {len(correct)} correctness flags")
    winner, _ = majority_vote(answers)
    if winner is None:
        return False
    return any(bool(c) for a, c in zip(answers, correct) if a == winner)


def maj_at_n(answers: Sequence[Sequence[Hashable | None]], correct: Sequence[Sequence[bool]]) -> float:
    """Fraction of problems whose majority-vote answer is correct (see ``maj_correct``)."""
    if len(answers) != len(correct) or not answers:
        raise ValueError(
            f"maj_at_n: {len(answers)} answer rows vs {len(correct)} correctness rows (need >= 1)"
        )
    return float(np.mean([maj_correct(a, c) for a, c in zip(answers, correct)]))


def summarize(
    correct: Sequence[Sequence[bool]],
    answers: Sequence[Sequence[Hashable | None]],
    lengths: Sequence[Sequence[int]],
    statuses: Sequence[Sequence[str]],
    finish_reasons: Sequence[Sequence[str]] | None = None,
    ks: Sequence[int] | None = None,
) -> dict:
    """All metrics of one dataset from per-problem lists of per-sample values ([P][n] each).

    Keys: ``num_problems``, ``n``, ``mean@{n}``, ``std``, ``pass@{k}`` for each k, ``maj@{n}``,
    ``mean_response_length`` (tokens), ``status_counts`` (verifier status -> samples), and
    ``truncated`` (fraction of samples that hit max_tokens) when finish reasons are given.
    Every problem must have the same number of samples n.
    """
    sizes = {len(row) for row in correct}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"summarize: every problem needs the same, non-zero number of samples; got sizes {sizes}"
        )
    n = sizes.pop()
    acc = per_problem_accuracy(correct)
    out: dict = {
        "num_problems": len(correct),
        "n": n,
        f"mean@{n}": float(acc.mean()),
        "std": float(acc.std()),
    }
    for k in ks or default_ks(n):
        if k > n:
            raise ValueError(f"summarize: pass@{k} needs k <= n = {n}")
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(sum(map(bool, row))), k) for row in correct]))
    out[f"maj@{n}"] = maj_at_n(answers, correct)
    out["mean_response_length"] = float(np.mean([x for row in lengths for x in row]))
    out["status_counts"] = dict(sorted(Counter(s for row in statuses for s in row).items()))
    if finish_reasons is not None:
        flat = [r for row in finish_reasons for r in row]
        out["truncated"] = sum(r == "length" for r in flat) / len(flat) if flat else 0.0
    return out
