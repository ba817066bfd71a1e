"""Rollout traces: records, truncation, and the best/worst summary CLI."""

from __future__ import annotations

from types import SimpleNamespace

from bandpo.run.traces import cut, eval_records, group_records, main, read_records, write_records


def test_cut_keeps_head_and_tail_within_limit():
    assert cut("short", 10) == "short" and cut(None, 5) is None
    text = "A" * 100 + "Answer: 42"
    out = cut(text, 60)
    assert (
        len(out) <= 60 + len(" [... 82 chars cut ...] ")
        and out.startswith("A")
        and out.endswith("Answer: 42")
    )
    assert "chars cut" in out


def _score(status, reward, extracted):
    return SimpleNamespace(status=status, reward=reward, extracted=extracted)


def test_group_records_and_cli(tmp_path, capsys):
    scores = [
        _score("correct", 1.0, "4"),
        _score("incorrect", -1.0, "5"),
        _score("no_answer", -1.0, None),
        _score("no_answer", -1.0, None),
    ]
    recs = group_records(
        3,
        ["p0", "p1"],
        ["2+2?", "3+3?"],
        ["4", "6"],
        ["..4", "..5", "x" * 50, "y"],
        scores,
        [1.0, -1.0, 0.0, 0.0],
        [0, 0, 1, 1],
        [3, 3, 50, 1],
        ["stop"] * 4,
        max_chars=20,
    )
    assert [r["reward_mean"] for r in recs] == [0.0, -1.0] and [r["accuracy"] for r in recs] == [0.5, 0.0]
    assert recs[0]["responses"][1] == {
        "text": "..5",
        "extracted": "5",
        "status": "incorrect",
        "reward": -1.0,
        "advantage": -1.0,
        "length": 3,
        "finish_reason": "stop",
    }
    assert "chars cut" in recs[1]["responses"][0]["text"]
    run = tmp_path / "run"
    write_records(run / "traces" / "step_3.jsonl", recs)
    assert read_records(run / "traces" / "step_3.jsonl") == recs
    assert main([str(run), "--step", "3", "--top", "1"]) == 0
    out = capsys.readouterr().out
    best, worst = out.split("== worst")
    assert "id=p0" in best and "id=p1" in worst and "1 with a single status" in out
    assert main([str(run), "--step", "4"]) == 2 and "step_3.jsonl" in capsys.readouterr().err


def test_eval_records():
    samples = {
        "tiny": [
            {
                "id": "q",
                "answer": "1",
                "responses": ["a", "b"],
                "extracted": ["1", None],
                "correct": [True, False],
                "status": ["correct", "no_answer"],
                "length": [1, 1],
                "finish_reason": ["stop", "length"],
            }
        ]
    }
    (rec,) = eval_records(5, samples, 100)
    assert (
        rec["dataset"] == "tiny" and rec["accuracy"] == 0.5 and rec["responses"][1]["status"] == "no_answer"
    )
