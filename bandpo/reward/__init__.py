"""Rule-based math reward: answer extraction, math-verify grading, a timed process pool.

Importable without Ray, vLLM or DeepSpeed. Typical use in a training loop::

    scorer = RewardScorer(RewardScheme(correct=1.0, incorrect=-1.0), answer_format="dapo")
    scores = scorer.score(responses, gold_answers)
    rewards = [s.reward for s in scores]

Modules: ``extract`` (answer strings), ``verify`` (``verify_one``, the in-process
grader), ``scheme`` (rewards and metrics), ``pool`` (``RewardScorer``, ``score_batch``),
``checks`` (the verifier's settings, checked once).

The names below load their module on first use (PEP 562), so that ``bandpo.reward.checks`` and
``bandpo.reward.scheme`` import without the grader's dependencies (pebble, math-verify): config
validation reads them where only training runs.
"""

import importlib

# name -> the module that defines it
_HOMES = {
    "VerifierUnavailable": "bandpo.errors",
    "ANSWER_FORMATS": "bandpo.reward.extract",
    "extract_answer": "bandpo.reward.extract",
    "normalize_gold": "bandpo.reward.extract",
    "RewardScorer": "bandpo.reward.pool",
    "score_batch": "bandpo.reward.pool",
    "check_error_share": "bandpo.reward.checks",
    "RewardScheme": "bandpo.reward.scheme",
    "Score": "bandpo.reward.scheme",
    "reward_metrics": "bandpo.reward.scheme",
    "random_rewards": "bandpo.reward.scheme",
    "random_positive": "bandpo.reward.scheme",
    "STATUSES": "bandpo.reward.verify",
    "verify_one": "bandpo.reward.verify",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'bandpo.reward' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # loaded once
    return value


__all__ = [
    "ANSWER_FORMATS",
    "STATUSES",
    "RewardScheme",
    "RewardScorer",
    "Score",
    "VerifierUnavailable",
    "check_error_share",
    "extract_answer",
    "normalize_gold",
    "random_positive",
    "random_rewards",
    "reward_metrics",
    "score_batch",
    "verify_one",
]
