"""A synthetic, verifiable arithmetic task for the tiny CPU recipe (``recipes/tiny_arith``).

Problems have integer answers and short worked solutions, so a 3M-parameter model can
learn them in minutes and the math verifier can score them exactly:

    kind       problem                                                   solution
    add        What is 347 + 85?                                         347+85=432\\nAnswer: 432
    sub        What is 512 - 87?                                         512-87=425\\nAnswer: 425
    mul        What is 12 * 7?                                           12*7=84\\nAnswer: 84
    two_step   Compute 23 + 45 - 17.                                     23+45=68\\n68-17=51\\nAnswer: 51
    word       Ann has 23 pens and buys 15 more. How many pens ...?      23+15=38\\nAnswer: 38

The problem text is only the question; a prompt template (e.g. the DAPO "Answer:" one)
wraps it. Answers are never negative (subtrahends are drawn no larger than the minuend).

Train / held-out separation does not depend on generating both sets together: every
problem has a canonical arithmetic key (commutative operands sorted, so "12 + 35",
"35 + 12" and "Ann has 12 pens and buys 35 more" share one key), and a hash of that key
assigns it to exactly one split. The two splits also use different random streams, and
within a split each (kind, key) appears once.

The train split has two halves (``part``), by a second, independent hash of the key: the tiny
recipe's warm start learns from "warm" and RL trains on "rl", problems the warm start never saw (on
the whole split RL's training accuracy started 6 points above held-out: it sampled problems the warm
start had memorised; recipes/tiny_arith/default.md). ``part=None`` is the whole split.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path

KINDS = ("add", "sub", "mul", "two_step", "word")
SPLITS = ("train", "test")
PARTS = ("warm", "rl")  # the train split's halves (module docstring)
DIFFICULTIES = (1, 2, 3, 4)
# The tiny recipe's level: its warm start and its RL data must use the same one. Level 1 has
# 2,677 distinct train problems, enough for the recipe's runs (configs/data/tiny_arith.yaml).
DEFAULT_DIFFICULTY = 1
# One key in _TEST_SHARE goes to the held-out split.
_TEST_SHARE = 8
# Draws per requested row before giving up (a small problem space may not hold n rows).
_MAX_DRAWS_PER_ROW = 200

_NAMES = ("Ann", "Ben", "Tom", "Mia", "Sam", "Lily", "Max", "Zoe")
_ITEMS = ("apples", "pens", "books", "coins", "cards", "eggs", "marbles", "stickers")


def make_split(
    name: str,
    n: int,
    seed: int = 0,
    *,
    difficulty: int = DEFAULT_DIFFICULTY,
    kinds: Iterable[str] = KINDS,
    part: str | None = None,
) -> list[dict]:
    """Generate ``n`` distinct problems of split ``name`` ("train" or "test").

    Args:
        name: "train" or "test"; the two never share a canonical arithmetic key.
        n: number of rows; within the split no two share both kind and canonical key.
        seed: random seed; the same (name, n, seed, difficulty, kinds) gives the same rows.
        difficulty: 1-4, the most digits of an operand (digit counts are drawn uniformly,
            so short numbers stay common); the second factor of a product and the
            factors inside two-step and word problems are always single digits.
        kinds: problem kinds to mix (uniformly), a subset of ``KINDS``.
        part: one half of the train split ("warm" or "rl", ``part_of``), or None for all of it. A part's
            rows are the whole split's rows of that part, in the same order.

    Returns:
        Rows ``{"id", "problem", "answer", "solution", "kind", "source"}``; ``answer`` is the
        integer answer as a string, ``solution`` the target completion ending in
        "Answer: <answer>".
    """
    if name not in SPLITS:
        raise ValueError(f"split name must be one of {SPLITS}, got {name!r}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if part is not None and (name != "train" or part not in PARTS):
        raise ValueError(
            f"part must be one of {PARTS} (of the train split) or None, got {part!r} of {name!r}"
        )
    # A str seed is hashed with SHA-512 by `random`, so streams are stable across runs
    # and Python versions (unlike hash()), and the splits draw from unrelated streams.
    rng = random.Random(f"tiny_arith:{name}:{seed}:{difficulty}")
    rows: list[dict] = []
    seen: set[tuple[str, str]] = set()
    for _ in range(_MAX_DRAWS_PER_ROW * max(n, 1)):
        if len(rows) == n:
            break
        kind = rng.choice(kinds)
        problem, solution, answer, key = _GENERATORS[kind](rng, difficulty)
        if (kind, key) in seen or split_of(key) != name or (part is not None and part_of(key) != part):
            continue
        seen.add((kind, key))
        rows.append(
            dict(
                id=f"tiny_arith-{name}{'-' + part if part else ''}-{seed}-{len(rows):05d}",
                problem=problem,
                answer=str(answer),
                solution=solution,
                kind=kind,
                source="tiny_arith",
            )
        )
    if len(rows) < n:
        raise ValueError(
            f"only {len(rows)} distinct {name}{f' ({part})' if part else ''} problems found for n={n} "
            f"(difficulty={difficulty}, kinds={kinds}); raise difficulty or add kinds"
        )
    return rows


def split_of(key: str) -> str:
    """The split ("train" or "test") that owns canonical key ``key``."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h % _TEST_SHARE == 0 else "train"


def part_of(key: str) -> str:
    """The half of the train split ("warm" or "rl") that owns canonical key ``key``: from hash bytes
    ``split_of`` does not read, so each half holds about half of every kind of train problem."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[8:16], "big")
    return PARTS[h % 2]


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> Path:
    """Write ``rows`` to ``path`` as JSON Lines, atomically (a reader sees the old file or the whole new
    one; parent folders created); returns the path."""
    from bandpo.checkpoint.atomic import write_text_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------------ generators
# Each returns (problem, solution, answer, canonical key).


def _number(rng: random.Random, max_digits: int, low: int = 0) -> int:
    # Digit count first, then the value: 1-digit numbers stay as common as 3-digit ones.
    digits = rng.randint(1, max_digits)
    return rng.randint(max(low, 10 ** (digits - 1) if digits > 1 else 0), 10**digits - 1)


def _step(a: int, op: str, b: int) -> tuple[str, int]:
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}={value}", value


def _key(a: int, op: str, b: int) -> str:
    if op in "+*":
        a, b = sorted((a, b))
    return f"{a}{op}{b}"


def _finish(problem: str, steps: list[str], answer: int, key: str):
    return problem, "\n".join(steps + [f"Answer: {answer}"]), answer, key


def _binary(rng: random.Random, difficulty: int, op: str) -> tuple[int, int]:
    if op == "*":
        return _number(rng, difficulty, low=2), rng.randint(2, 9)
    a, b = _number(rng, difficulty), _number(rng, difficulty)
    if op == "-" and b > a:
        a, b = b, a
    return a, b


def _gen_simple(op: str):
    def gen(rng: random.Random, difficulty: int):
        a, b = _binary(rng, difficulty, op)
        if op == "*" and rng.random() < 0.5:
            a, b = b, a
        step, value = _step(a, op, b)
        return _finish(f"What is {a} {op} {b}?", [step], value, _key(a, op, b))

    return gen


def _gen_two_step(rng: random.Random, difficulty: int):
    form = rng.randrange(3)
    if form == 0:  # (a op1 b) op2 c, left to right, add/sub only
        a, b, c = (_number(rng, difficulty) for _ in range(3))
        op1, op2 = rng.choice("+-"), rng.choice("+-")
        if op1 == "-" and b > a:
            a, b = b, a
        s1, v1 = _step(a, op1, b)
        if op2 == "-" and c > v1:
            c = rng.randint(0, v1)
        s2, v2 = _step(v1, op2, c)
        text = f"{a} {op1} {b} {op2} {c}"
        key = f"({_key(a, op1, b)}){op2}{c}"
    elif form == 1:  # a * b op c: the product first
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), _number(rng, difficulty)
        op = rng.choice("+-")
        s1, v1 = _step(a, "*", b)
        if op == "-" and c > v1:
            c = rng.randint(0, v1)
        s2, v2 = _step(v1, op, c)
        text = f"{a} * {b} {op} {c}"
        key = f"({_key(a, '*', b)}){op}{c}"
    else:  # c + a * b: precedence, the product is still computed first
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), _number(rng, difficulty)
        s1, v1 = _step(a, "*", b)
        s2, v2 = _step(c, "+", v1)
        text = f"{c} + {a} * {b}"
        key = f"({_key(a, '*', b)})+{c}"
    return _finish(f"Compute {text}.", [s1, s2], v2, key)


def _gen_word(rng: random.Random, difficulty: int):
    who, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    form = rng.randrange(4)
    if form == 0:
        a, b = _number(rng, difficulty, low=1), _number(rng, difficulty, low=1)
        text = f"{who} has {a} {items} and buys {b} more. How many {items} does {who} have now?"
        steps, value = [_step(a, "+", b)[0]], a + b
        key = _key(a, "+", b)
    elif form == 1:
        a, b = _number(rng, difficulty, low=1), _number(rng, difficulty, low=1)
        a, b = max(a, b), min(a, b)
        text = f"{who} has {a} {items} and gives away {b}. How many {items} are left?"
        steps, value = [_step(a, "-", b)[0]], a - b
        key = _key(a, "-", b)
    elif form == 2:
        a, b = rng.randint(2, 9), _number(rng, difficulty, low=2)
        text = f"There are {a} boxes with {b} {items} in each box. How many {items} are there in total?"
        steps, value = [_step(a, "*", b)[0]], a * b
        key = _key(a, "*", b)
    else:
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), _number(rng, difficulty, low=1)
        text = (
            f"{who} buys {a} packs of {b} {items} and then finds {c} more. How many {items} does {who} have?"
        )
        s1, v1 = _step(a, "*", b)
        steps, value = [s1, _step(v1, "+", c)[0]], v1 + c
        key = f"({_key(a, '*', b)})+{c}"
    return _finish(text, steps, value, key)


_GENERATORS = {
    "add": _gen_simple("+"),
    "sub": _gen_simple("-"),
    "mul": _gen_simple("*"),
    "two_step": _gen_two_step,
    "word": _gen_word,
}
