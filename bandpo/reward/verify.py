"""Grading one (response, gold answer) pair with math-verify, in-process.

``verify_one`` is the reference grader, the one the sequential benchmark baseline calls
in a loop. The pool in ``pool.py`` extracts answers in the parent and runs the second
half, ``verify_extracted``, in worker processes (``verify_one`` itself where math-verify
has to search the whole response); both paths give the same grade.

math-verify guards ``parse``/``verify`` with ``signal.alarm``, which only works on the
main thread of the main interpreter, and on expiry it logs a warning and returns "no
match" — a timeout silently becomes a wrong answer. We switch that mechanism off
(``parsing_timeout=None``, ``timeout_seconds=None``) and let the pool enforce a hard
timeout from outside the process, so a hang is reported as ``timeout``. Called
directly, ``verify_one`` therefore has no time limit at all.
"""

from __future__ import annotations

import functools
import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from bandpo.reward.extract import ANSWER_FORMATS, extract_answer, normalize_gold

STATUSES = ("correct", "incorrect", "no_answer", "timeout", "error", "invalid_input")

# math-verify's own extraction (the ``auto`` fallback) scans this many trailing characters:
# the final answer sits at the end, and scanning a whole 16k-character response with its
# many regexes costs more than the rest of the grading.
FALLBACK_TAIL_CHARS = 2000
_MV_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_MATH_DELIMITER_RE = re.compile(r"(?<!\\)\$|\\\(|\\\[")  # "$" (not "\$"), "\(", "\["


class _DropTimeoutDisabledWarning(logging.Filter):
    """Hide math-verify's "Timeout is disabled" warning: disabling it is deliberate here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _mv_parse(text: str) -> list:
    return parse(text, extraction_config=_MV_CONFIG, parsing_timeout=None)


@functools.lru_cache(maxsize=8192)
def _parse_answer(answer: str) -> tuple:
    """math-verify parse of an already extracted answer string (cached).

    A bare answer (``\\frac{1}{2}``, ``50\\%``) is wrapped in ``$...$`` so that the LaTeX
    extractor sees it as math; one that still holds math delimiters (``the answer is $5$``)
    is handed over as is and math-verify picks the segment. The cache matters: the n
    samples of a prompt repeat a few answers, the gold is graded n times per step, and
    a LaTeX parse costs milliseconds (math-verify's own cache keeps only 20 entries).
    """
    if _MATH_DELIMITER_RE.search(answer):
        return tuple(_mv_parse(answer))
    return tuple(_mv_parse(f"${answer}$"))


def gold_text(answer: object) -> str | None:
    """The gold answer as a non-empty string, or None when it is missing or of a wrong type."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return str(answer)
    if isinstance(answer, str) and answer.strip():
        return answer
    return None


def verify_one(response: object, answer: object, answer_format: str = "auto") -> tuple[str, str | None]:
    """Grade one response against its gold answer; never raises.

    Args:
        response: the model's text. Anything but a ``str`` is ``invalid_input``.
        answer: the gold answer (``str``, ``int`` or ``float``; an empty string or any other
            type is ``invalid_input``).
        answer_format: ``dapo`` | ``boxed`` | ``auto`` (see ``extract.py``). With ``auto``,
            a response with neither an ``Answer:`` line nor a box is graded on whatever
            math-verify's own extraction finds in its tail.

    Returns:
        ``(status, extracted)``: status is ``correct``, ``incorrect``, ``no_answer``,
        ``error`` (an unexpected exception) or ``invalid_input``; ``extracted`` is the
        answer string taken from the response, or None.
    """
    if answer_format not in ANSWER_FORMATS:
        return "invalid_input", None
    gold = gold_text(answer)
    if not isinstance(response, str) or gold is None:
        return "invalid_input", None
    try:
        extracted = extract_answer(response, answer_format)
    except Exception:
        logging.getLogger(__name__).debug("extract_answer failed", exc_info=True)
        return "error", None
    if extracted is not None:
        return verify_extracted(extracted, gold), extracted
    if answer_format != "auto":
        return "no_answer", None
    try:
        predicted = _mv_parse(response[-FALLBACK_TAIL_CHARS:])
    except Exception:
        logging.getLogger(__name__).debug("math-verify extraction failed", exc_info=True)
        return "error", None
    # parse returns [sympy object, source string] or [source string]
    extracted = str(predicted[-1]) if predicted else None
    return _compare(predicted, gold), extracted


def verify_extracted(extracted: str, gold: str) -> str:
    """Grade an answer string already extracted from a response; never raises.

    The grade depends on nothing else of the response, which is what lets the pool grade
    each distinct (extracted, gold) pair of a batch once. Returns ``correct``,
    ``incorrect``, ``no_answer`` (nothing parseable) or ``error``.
    """
    try:
        return _compare(list(_parse_answer(extracted)), gold)
    except Exception:
        logging.getLogger(__name__).debug("verify_extracted failed", exc_info=True)
        return "error"


def _compare(predicted: list, gold: str) -> str:
    if not predicted:
        return "no_answer"
    try:
        ok = verify(list(_parse_answer(normalize_gold(gold))), predicted, timeout_seconds=None)
    except Exception:  # a grader bug must cost one sample, not the batch
        logging.getLogger(__name__).debug("math-verify comparison failed", exc_info=True)
        return "error"
    return "correct" if ok else "incorrect"
