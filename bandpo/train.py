"""Training entry point: ``python -m bandpo.train [hydra overrides...]`` (what scripts/train.sh runs).

The config is composed and validated before any worker starts, so a bad override fails in
seconds naming the key (exit code 2).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from bandpo.config import ConfigError, compose

    try:
        cfg = compose(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from bandpo.trainer import train

    metrics = train(cfg)
    summary = {k: v for k, v in metrics.items() if k.startswith(("eval/", "reward/")) and "@" in k or k == "reward/mean"}
    print(f"[bandpo] done: {cfg.trainer.total_steps} steps, outputs in {cfg.trainer.output_dir}")
    for k, v in sorted(summary.items()):
        print(f"  {k} = {v:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
