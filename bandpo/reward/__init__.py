"""Rule-based math reward: answer extraction, math-verify grading, a timed process pool.

Importable without Ray, vLLM or DeepSpeed. Typical use in a training loop::

    scorer = RewardScorer(RewardScheme(correct=1.0, incorrect=-1.0), answer_format="dapo")
    scores = scorer.score(responses, gold_answers)
    rewards = [s.reward for s in scores]

Modules: ``extract`` (answer strings), ``verify`` (``verify_one``, the in-process
grader), ``scheme`` (rewards and metrics), ``pool`` (``RewardScorer``, ``score_batch``).
"""

from bandpo.errors import VerifierUnavailable
from bandpo.reward.extract import ANSWER_FORMATS, extract_answer, normalize_gold
from bandpo.reward.pool import RewardScorer, check_error_share, score_batch
from bandpo.reward.scheme import RewardScheme, Score, reward_metrics
from bandpo.reward.verify import STATUSES, verify_one

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
    "reward_metrics",
    "score_batch",
    "verify_one",
]
