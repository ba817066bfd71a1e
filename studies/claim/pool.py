"""Test 2's pool, chosen by measurement before its pilot: samples of the candidate problem kinds and
levels, written as JSONL for one base-model evaluation (``protocol.md``, amendment 3).

    python -m studies.claim.pool --out DIR     # writes DIR/<candidate>.jsonl, prints the evaluation

The protocol's pool (60% level-1 one-operation problems of >= 2,000) cannot be built: level 1 holds
under 300 distinct one-operation training problems (and under 16 held-out ones). So the base model's
accuracy is measured on each candidate below, on the first problems of the training split a pool
would draw from (the base model has trained on neither split, and the pilot's gate is its training
accuracy), at the runs' sampling settings, and the pilot's mix is fixed from those numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bandpo.data.tiny_arith_problems import make_split, write_jsonl

# name -> (difficulty, kinds); level 1 all kinds is Test 1's pool (distinct training problems: 2,677)
CANDIDATES = {
    "l1_all": (1, ("add", "sub", "mul", "two_step", "word")),
    "l1_one_op": (1, ("add", "sub", "mul")),
    "l1_word": (1, ("word",)),
    "l1_two_step": (1, ("two_step",)),
    "l2_add_sub": (2, ("add", "sub")),
    "l2_mul": (2, ("mul",)),
    "l2_word": (2, ("word",)),
}
SIZE = 32  # problems a candidate; 32 x 4 samples: a 0.3 accuracy is known to about +-0.08 (problems vary)


def write_candidates(out: Path, size: int = SIZE, seed: int = 0) -> dict[str, Path]:
    """One JSONL of ``size`` training-split problems per candidate in ``out``; returns name -> file."""
    return {
        name: write_jsonl(out / f"{name}.jsonl", make_split("train", size, seed, difficulty=d, kinds=kinds))
        for name, (d, kinds) in CANDIDATES.items()
    }


def eval_command(files: dict[str, Path], checkpoint: str, out: Path) -> str:
    """The base model's evaluation of every candidate at the claim runs' sampling settings (fp32,
    the boxed template, temperature 0.6, 256 tokens), 4 samples a problem, seeded."""
    paths = ",".join(str(p) for p in files.values())
    return (
        f"scripts/eval.sh checkpoint={checkpoint} eval.paths=[{paths}] eval.n=4 eval.temperature=0.6 "
        "eval.max_tokens=256 eval.template=boxed eval.answer_format=auto eval.seed=0 "
        f"eval.engine.dtype=float32 --out {out}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the candidates' JSONL files")
    ap.add_argument(
        "--checkpoint",
        default=str(Path.home() / ".cache/bandpo/smollm2-135m-instruct-q4_1"),
        help="the base model's folder (model=smollm2-135m builds it there)",
    )
    args = ap.parse_args(argv)
    files = write_candidates(args.out)
    for name, path in files.items():
        print(f"{name}: {path}")
    print(eval_command(files, args.checkpoint, args.out / "eval"))


if __name__ == "__main__":
    main()
