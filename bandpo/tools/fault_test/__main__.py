"""``python -m bandpo.tools.fault_test [--kills K] [--seed S] [--out DIR] OVERRIDES...`` (see the package doc)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bandpo.tools.fault_test.runner import FaultTest, Options, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/fault_test.sh",
        description="SIGKILL a training run (driver, Ray, workers) at random moments, resume it each time, and "
        "check it against an uninterrupted run with the same overrides.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for scripts/train.sh")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs of the whole run (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default 0)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/fault_test"),
        help="folder for reference/, killed/, logs/ and fault_test.json; those are replaced "
        "(default runs/fault_test)",
    )
    parser.add_argument(
        "--attempt-timeout",
        type=float,
        default=3600.0,
        help="seconds one training attempt may take (default 3600)",
    )
    args = parser.parse_args(argv)
    try:
        test = FaultTest(Options(args.overrides, args.out, args.kills, args.seed, args.attempt_timeout))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    report = test.run()
    print(summary(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
