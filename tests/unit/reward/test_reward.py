"""Reward: extraction, math-verify grading, reward scheme, metrics (in-process, no pool).

The pool (timeouts, killed workers) is tested in ``test_reward_pool.py``.
"""

from __future__ import annotations

import pytest

from bandpo.reward import (
    RewardScheme,
    Score,
    extract_answer,
    normalize_gold,
    reward_metrics,
    verify_one,
)
from bandpo.reward.extract import clean_answer, last_answer_line, last_boxed

C, I, N, V = "correct", "incorrect", "no_answer", "invalid_input"  # noqa: E741 - short, for the table

# (response, gold, expected status[, answer_format]); answer_format defaults to "auto".
CASES = [
    # integers, leading zeros, thousands separators, signs
    ("The sum is 25.\nAnswer: 25", "025", C),
    ("Answer: 025", "25", C),
    ("Answer: 7", "007", C),
    ("Answer: 1,000", "1000", C),
    ("Answer: $1{,}000$", "1,000", C),
    ("Answer: 1\\,000", "1000", C),
    ("Answer: 12345", "12,345", C),
    ("Answer: -3", "-3", C),
    ("Answer: -3", "3", I),
    ("Answer: 3", "-3", I),
    ("Answer: 28", "27", I),
    ("Answer: 27", 27, C),
    # fractions, decimals, radicals, pi
    ("Answer: $\\frac{1}{2}$", "0.5", C),
    ("Answer: 0.5", "\\frac{1}{2}", C),
    ("Answer: \\dfrac{3}{4}", "3/4", C),
    ("Answer: 0.75", "\\frac34", C),
    ("Answer: \\frac{2}{4}", "\\frac{1}{2}", C),
    ("Answer: 0.333", "\\frac{1}{3}", I),
    ("Answer: \\frac{1}{3}", "\\frac{1}{2}", I),
    ("Answer: \\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", C),
    ("so $\\boxed{\\frac{\\sqrt2}{2}}$", "\\frac{\\sqrt{2}}{2}", C),
    ("Answer: 10\\sqrt{3}", "10\\sqrt3", C),
    ("Answer: 2\\sqrt{3}", "\\sqrt{12}", C),
    ("Answer: \\sqrt{3}", "\\sqrt{2}", I),
    ("Answer: \\pi", "\\pi", C),
    ("Answer: 2\\pi/3", "\\frac{2\\pi}{3}", C),
    ("Answer: 3.14159", "\\pi", I),
    ("Answer: 4\\pi", "2\\pi", I),
    ("Answer: -\\frac{1}{2}", "-0.5", C),
    # intervals, tuples, sets
    ("Answer: [0, 1)", "[0,1)", C),
    ("Answer: (0, 1]", "[0,1)", I),
    ("Answer: (1, 2)", "(1,2)", C),
    ("Answer: (2, 3)", "(3,2)", I),
    ("Answer: \\{1, 2\\}", "\\{2,1\\}", C),
    ("Answer: 2, 3", "2, 3", C),
    ("Answer: (-\\infty, 5)", "(-\\infty,5)", C),
    # percent, degrees, units, \text{}
    ("Answer: 50\\%", "50", C),
    ("Answer: 50", "50\\%", C),
    ("Answer: 30^\\circ", "30", C),
    ("Answer: 30", "30^{\\circ}", C),
    ("Answer: 27 miles", "27", C),
    ("Answer: 27 \\text{ miles}", "27", C),
    ("Answer: 12 \\text{ cm}", "12\\text{ cm}", C),
    ("Answer: \\$12", "12", C),
    ("Answer: \\text{(B)}", "B", C),
    ("Answer: 5", "\\text{5}", C),
    ("Answer: 5", "$5$", C),
    ("Answer: 5", "\\boxed{5}", C),
    # equations and expressions
    ("Answer: x = 5", "5", C),
    ("Answer: $x^2 + 1$", "1 + x^2", C),
    ("Answer: x^2 - 1", "(x-1)(x+1)", C),
    ("Answer: x + 2", "x + 1", I),
    # boxed: last wins, nested braces, \fbox, brace-less, unclosed
    ("First $\\boxed{3}$, then $\\boxed{4}$.", "4", C),
    ("First $\\boxed{3}$, then $\\boxed{4}$.", "3", I),
    ("\\boxed{\\frac{\\frac{1}{2}}{2}}", "1/4", C),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", C),
    ("\\fbox{6}", "6", C),
    ("\\boxed 6", "6", C),
    ("So \\boxed{\\frac{1}{2", "1/2", N, "boxed"),
    ("\\[\\boxed{27}\\]", "27", C, "boxed"),
    # DAPO "Answer:" line: forms, tail, last line wins
    ("Answer: $5$", "5", C, "dapo"),
    ("**Answer:** 12", "12", C, "dapo"),
    ("Answer: $\\boxed{12}$.", "12", C, "dapo"),
    ("Answer: \\(12\\)", "12", C, "dapo"),
    ("Answer:\n\n17", "17", C, "dapo"),
    ("answer: 17", "17", C, "dapo"),
    ("Answer: 3\nWait, let me recheck.\nAnswer: 4", "4", C, "dapo"),
    ("Answer: 5 " + "and more words " * 40, "5", N, "dapo"),
    ("Answer: 5\n" + "x" * 400, "5", N, "dapo"),
    ("The answer is \\boxed{5}", "5", N, "dapo"),
    ("Answer: 5", "5", N, "boxed"),
    # auto: the later of "Answer:" and a box; math-verify's own extraction as fallback
    ("\\boxed{3} is wrong.\nAnswer: 4", "4", C),
    ("Answer: 3, but actually \\boxed{4}", "4", C),
    ("The final answer is $7$. I hope it is correct.", "7", C),
    ("I think it is 42", "42", C),
    ("so we keep going and going without ever concluding", "42", N),
    # degenerate inputs
    ("", "7", N),
    ("Answer: $$", "3", N),
    ("Answer: \\boxed{}", "3", N),
    (None, "7", V),
    (42, "42", V),
    (b"Answer: 4", "4", V),
    ("Answer: 7", None, V),
    ("Answer: 7", "", V),
    ("Answer: 7", "   ", V),
    ("Answer: 7", ["7"], V),
    ("Answer: 7", True, V),
]


def _case_id(case: tuple) -> str:
    return repr(case[0])[:30] + " | " + repr(case[1])[:15]


def test_table_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_verify_one_table(case):
    response, gold, expected, *fmt = case
    status, extracted = verify_one(response, gold, *fmt)
    assert status == expected, (status, extracted)
    if status == "correct":
        assert extracted


def test_verify_one_bad_format_is_invalid_input_not_an_exception():
    assert verify_one("Answer: 1", "1", "latex") == ("invalid_input", None)


# -- extraction ---------------------------------------------------------------------------


def test_last_boxed_balanced_braces_and_positions():
    text = "a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}} c"
    content, pos = last_boxed(text)
    assert content == "\\frac{1}{\\sqrt{2}}"
    assert text[pos:].startswith("\\boxed{\\frac")
    assert last_boxed("no box here") == (None, -1)
    assert last_boxed("\\boxed{\\{1, 2\\}}")[0] == "\\{1, 2\\}"
    assert last_boxed("\\fbox{x}")[0] == "x"
    assert last_boxed("\\boxed {5}")[0] == "5"


def test_last_boxed_unclosed_last_box_is_not_replaced_by_an_earlier_one():
    content, pos = last_boxed("\\boxed{1} then \\boxed{\\frac{2}{3")
    assert content is None and pos > 0


def test_answer_line_only_in_tail():
    assert last_answer_line("Answer: 5")[0] == "5"
    assert last_answer_line("Answer: 5\n" + "y" * 400)[0] is None
    assert last_answer_line("Answer: 5\n" + "y" * 400, tail_chars=1000)[0] == "5"


@pytest.mark.parametrize(
    "raw, cleaned",
    [
        ("  $5$. ", "5"),
        ("**12**", "12"),
        ("$$\\frac{1}{2}$$", "\\frac{1}{2}"),
        ("\\(x\\)", "x"),
        ("\\[7\\]", "7"),
        ("$\\boxed{3}$", "3"),
        ("$a$ and $b$", "$a$ and $b$"),
        ("$\\$12$", "\\$12"),
    ],
)
def test_clean_answer(raw, cleaned):
    assert clean_answer(raw) == cleaned


@pytest.mark.parametrize(
    "gold, normalized",
    [
        ("025", "25"),
        ("-007", "-7"),
        ("1,000", "1000"),
        ("1{,}234{,}567", "1234567"),
        ("$42$", "42"),
        ("\\boxed{42}", "42"),
        ("\\text{(B)}", "(B)"),
        ("1,2", "1,2"),
        ("0.5", "0.5"),
        (" 3 ", "3"),
    ],
)
def test_normalize_gold(gold, normalized):
    assert normalize_gold(gold) == normalized


def test_extract_answer_formats():
    both = "\\boxed{1}\nAnswer: 2"
    assert extract_answer(both, "dapo") == "2"
    assert extract_answer(both, "boxed") == "1"
    assert extract_answer(both, "auto") == "2"
    assert extract_answer("nothing", "auto") is None
    with pytest.raises(ValueError, match="answer_format"):
        extract_answer(both, "latex")


# -- reward scheme and metrics ------------------------------------------------------------


def test_reward_scheme_values():
    paper = RewardScheme()
    assert paper.reward("correct") == 1.0
    for status in ("incorrect", "no_answer", "timeout", "error", "invalid_input"):
        assert paper.reward(status) == -1.0
    zero_one = RewardScheme(correct=1.0, incorrect=0.0, format_penalty=-0.5)
    assert zero_one.reward("incorrect") == 0.0
    assert zero_one.reward("no_answer") == -0.5
    assert zero_one.reward("timeout") == 0.0


def test_overlong_shaping_matches_dapo():
    # DAPO: expected = L - B; penalty = min(-(len - expected) / B * factor, 0)
    s = RewardScheme(overlong_buffer=100, overlong_penalty=1.0, max_response_len=1000)
    assert s.reward("correct", 900) == 1.0
    assert s.reward("correct", 950) == pytest.approx(0.5)
    assert s.reward("correct", 1000) == pytest.approx(0.0)
    assert s.reward("incorrect", 1000) == pytest.approx(-2.0)
    assert s.reward("correct", 10) == 1.0
    half = RewardScheme(overlong_buffer=100, overlong_penalty=0.5, max_response_len=1000)
    assert half.reward("correct", 1000) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs",
    [{"overlong_buffer": -1}, {"overlong_buffer": 10}, {"overlong_buffer": 10, "max_response_len": 10}],
)
def test_reward_scheme_rejects_bad_shaping(kwargs):
    with pytest.raises(ValueError, match="overlong_buffer"):
        RewardScheme(**kwargs)


def test_reward_metrics():
    scores = [
        Score(1.0, "correct", "1", True),
        Score(-1.0, "incorrect", "2", False),
        Score(-1.0, "timeout", None, False),
        Score(1.0, "correct", "1", True),
    ]
    m = reward_metrics(scores)
    # Hand: rewards 1 - 1 - 1 + 1 = 0 over 4; 2 of 4 correct; one each of incorrect and timeout.
    assert m == {
        "reward/mean": 0.0,
        "reward/accuracy": 0.5,
        "reward/frac_correct": 0.5,
        "reward/frac_incorrect": 0.25,
        "reward/frac_timeout": 0.25,
    }
    empty = reward_metrics([])
    assert empty == {"reward/mean": 0.0, "reward/accuracy": 0.0}


def test_reward_package_imports_without_heavy_engines():
    import subprocess
    import sys

    code = (
        "import sys, bandpo.reward; "
        "bad = [m for m in ('ray', 'vllm', 'deepspeed', 'torch') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
