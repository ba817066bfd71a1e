"""Answer extraction and string normalization (pure Python, no sympy).

Two prompt formats are supported (the paper's DAPO prompt and the boxed convention):

- ``dapo``:  the last ``Answer: ...`` line within the tail of the response, exactly
  the pattern of DAPO's reward (``(?i)Answer\\s*:\\s*([^\\n]+)`` on the last 300 chars).
- ``boxed``: the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces).
- ``auto``:  whichever of the two occurs last in the response; ``verify_one`` then falls
  back to math-verify's own extraction when neither is present.

Everything here is cheap string work; the expensive, possibly hanging sympy part lives
in ``verify.py`` and runs in worker processes.
"""

from __future__ import annotations

import re

from bandpo.errors import check_choice

ANSWER_FORMATS = ("dapo", "boxed", "auto")

# DAPO scores only the response tail: the longest MATH-500 answer has 159 characters, and
# a short tail stops an early "Answer:" (e.g. restating the task) from being picked up.
DAPO_TAIL_CHARS = 300
_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_MARKDOWN_EMPHASIS_RE = re.compile(r"^[*_]+|[*_]+$")
_TEXT_RE = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{(.*)\}$", re.DOTALL)
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:(?:,|\{,\}|\\,|\\!|\\ |~)\d{3})+(?:\.\d+)?$")
_THOUSANDS_SEP_RE = re.compile(r",|\{,\}|\\,|\\!|\\ |~")
_LEADING_ZEROS_RE = re.compile(r"^([+-]?)0+(\d+)$")
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_ENCLOSURES = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def last_boxed(text: str) -> tuple[str | None, int]:
    """Content of the last ``\\boxed``/``\\fbox`` in ``text`` and its start index.

    Handles nested braces (``\\boxed{\\frac{1}{2}}``) and the brace-less form
    ``\\boxed 5``. Returns ``(None, -1)`` when there is no box, and ``(None, start)``
    when the last box is never closed (a truncated response): its final answer is
    unknown, and an earlier box is typically an intermediate result, so it is not used.
    """
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None, -1
    start = matches[-1].start()
    i = matches[-1].end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None, start
    if text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:])
        return (token.group(0) if token else None), start
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], start
        j += 1
    return None, start


def last_answer_line(text: str, tail_chars: int = DAPO_TAIL_CHARS) -> tuple[str | None, int]:
    """The rest of the last ``Answer:`` line within the last ``tail_chars`` characters.

    Returns ``(content, start index in text)`` or ``(None, -1)``.
    """
    offset = max(len(text) - tail_chars, 0)
    last = None
    for last in _DAPO_ANSWER_RE.finditer(text, offset):
        pass
    if last is None:
        return None, -1
    return last.group(1), last.start()


def clean_answer(answer: str) -> str:
    """Strip the wrapping a model puts around a final answer.

    Removes surrounding whitespace, markdown emphasis, a trailing period, a ``\\boxed{}``
    wrapper (last box wins) and one enclosing math delimiter pair (``$..$``, ``$$..$$``,
    ``\\(..\\)``, ``\\[..\\]``). Text between several math segments is kept as is, so
    that math-verify can pick the segment itself.
    """
    s = answer.strip()
    s = _MARKDOWN_EMPHASIS_RE.sub("", s).strip()
    s = s.rstrip(".。").strip()
    boxed, _ = last_boxed(s)
    if boxed is not None:
        s = boxed.strip()
    for left, right in _ENCLOSURES:
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            inner = s[len(left) : len(s) - len(right)]
            if left.startswith("$") and _UNESCAPED_DOLLAR_RE.search(inner):
                continue  # "$a$ and $b$": not one enclosing pair
            s = inner.strip()
            break
    return s.rstrip(".").strip()


def normalize_number(s: str) -> str:
    """Canonical form of a plain integer/decimal: drop thousands separators and leading zeros.

    ``"1,000"``, ``"1{,}000"``, ``"1\\,000"`` -> ``"1000"``; ``"025"`` -> ``"25"``.
    Anything that is not a plain number is returned unchanged (``"1,2"`` stays a pair).
    """
    if _THOUSANDS_RE.match(s):
        s = _THOUSANDS_SEP_RE.sub("", s)
    m = _LEADING_ZEROS_RE.match(s)
    if m:
        s = m.group(1) + m.group(2)
    return s


def normalize_gold(gold: str) -> str:
    """Ground truth -> the string handed to math-verify.

    Strips whitespace, surrounding ``$``/``\\boxed{}``, a whole-answer ``\\text{...}``,
    thousands separators and leading zeros (AIME golds come as ``"025"``).
    """
    s = clean_answer(gold)
    m = _TEXT_RE.match(s)
    if m:
        s = m.group(1).strip()
    return normalize_number(s)


def extract_answer(response: str, answer_format: str = "auto") -> str | None:
    """The final answer string of ``response`` in the given format, cleaned, or None.

    ``answer_format`` is one of ``ANSWER_FORMATS``; with ``auto`` the later of the last
    ``Answer:`` line and the last box wins. An empty answer (``"Answer: $ $"``) is None.
    Raises ValueError for an unknown format.
    """
    check_choice(answer_format, ANSWER_FORMATS, "answer_format")
    found = []
    if answer_format != "boxed":
        line, pos = last_answer_line(response)
        found.append((pos, line))
    if answer_format != "dapo":
        box, pos = last_boxed(response)
        found.append((pos, box))
    found = [(pos, raw) for pos, raw in found if raw is not None]
    if not found:
        return None
    _, raw = max(found, key=lambda item: item[0])
    cleaned = normalize_number(clean_answer(raw))
    return cleaned or None
