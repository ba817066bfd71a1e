"""The end-of-run summary (bandpo.train.summary): first -> last, the change in points."""

from __future__ import annotations

import json

from bandpo.train import summary


def test_summary_gives_before_after_and_change(tmp_path):
    key = "eval/tiny_arith_test/mean@32"
    rows = [
        {"step": 0, key: 0.7589},
        {"step": 1, "reward/mean": 0.5, "reward/accuracy": 0.75},
        {"step": 2, "reward/mean": 0.6, "reward/accuracy": 0.8},
        {"step": 2, "final": True, key: 0.8227},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = summary(path, 2)
    # (0.8227 - 0.7589) x 100 = 6.38 -> "+6.4 points"
    assert f"  {key:<34} step 0: 0.7589 -> step 2: 0.8227 (+6.4 points)" in text.splitlines()
    assert "  reward/accuracy                    step 1: 0.7500 -> step 2: 0.8000" in text.splitlines()
