"""Evaluation: metric math against hand-computed cases, the aggregation pipeline, the CLI, and end to end."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from bandpo.errors import EvalUsageError
from bandpo.eval.evaluate import (
    evaluate,
    flatten_metrics,
    load_cli_config,
    markdown_table,
    run_eval,
    to_eval_config,
)
from bandpo.eval.metrics import (
    default_ks,
    maj_at_n,
    maj_correct,
    majority_vote,
    mean_at_n,
    pass_at_k,
    summarize,
)
from bandpo.eval.targets import find_hf_folder, resolve_targets
from bandpo.types import Example, RolloutBatch, SamplingParams
from bandpo.viz import plot_pass_at_k

# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 0, 2, 0.0),
        (4, 4, 2, 1.0),
        (4, 4, 4, 1.0),
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (4, 1, 4, 1.0),  # n - c < k: every 4-subset holds the correct one
        (32, 1, 32, 1.0),
        (32, 1, 16, 0.5),  # 1 - C(31,16)/C(32,16) = 16/32
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomials_and_is_stable():
    for n in (1, 2, 7, 16, 33):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    # Huge n: binomials overflow floats, the product form does not.
    assert pass_at_k(5000, 1, 1) == pytest.approx(1 / 5000)
    assert 0.0 < pass_at_k(5000, 3, 100) < 1.0


def test_pass_at_k_rejects_bad_input():
    for args in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(*args)


def test_default_ks():
    assert default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(1) == [1]


# ---------------------------------------------------------------- mean@n, maj@n


def test_mean_at_n():
    assert mean_at_n([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]) == pytest.approx(5 / 12)
    assert mean_at_n([[True, False]]) == 0.5


def test_majority_vote_ties_go_to_first_seen():
    assert majority_vote(["b", "a", "a", "b"]) == ("b", 2)  # b appears first
    assert majority_vote(["a", "b", "b", "a"]) == ("a", 2)
    assert majority_vote(["c", "a", "b", "b"]) == ("b", 2)
    assert majority_vote([None, "", None]) == (None, 0)
    assert majority_vote([None, "7", None]) == ("7", 1)  # abstentions do not vote


def test_maj_correct_cases():
    assert maj_correct(["5", "5", "3", "4"], [True, True, False, False])
    assert not maj_correct(["3", "3", "5"], [False, False, True])  # the right answer is in the minority
    # A tie: the first-seen answer wins, whatever its correctness.
    assert not maj_correct(["3", "5", "5", "3"], [False, True, True, False])
    assert maj_correct(["5", "3", "3", "5"], [True, False, False, True])
    # One sample of the winning answer timed out in the verifier: still correct.
    assert maj_correct(["5", "5", "2"], [False, True, False])
    assert not maj_correct([None, None], [False, False])


def test_maj_at_n():
    answers = [["1", "1", "2"], ["3", "4", "4"], [None, None, None]]
    correct = [[True, True, False], [True, False, False], [False, False, False]]
    assert maj_at_n(answers, correct) == pytest.approx(1 / 3)


def test_summarize_hand_case():
    correct = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    answers = [["2", "3", "3", "4"], ["9"] * 4, [None, "1", "1", None]]
    lengths = [[10, 20, 30, 40], [5] * 4, [1] * 4]
    statuses = [
        ["correct", "incorrect", "incorrect", "incorrect"],
        ["correct"] * 4,
        ["no_answer", "incorrect", "incorrect", "timeout"],
    ]
    finish = [["stop"] * 4, ["stop"] * 4, ["length", "stop", "stop", "length"]]
    s = summarize(correct, answers, lengths, statuses, finish)
    assert s["num_problems"] == 3 and s["n"] == 4
    assert s["mean@4"] == pytest.approx(5 / 12)
    accs = [0.25, 1.0, 0.0]
    mean = sum(accs) / 3
    assert s["std"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in accs) / 3))
    assert s["pass@1"] == pytest.approx(5 / 12)
    assert s["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert s["pass@4"] == pytest.approx(2 / 3)
    assert s["maj@4"] == pytest.approx(1 / 3)  # problem 0 votes "3" (wrong), problem 1 right, problem 2 wrong
    assert s["mean_response_length"] == pytest.approx((100 + 20 + 4) / 12)
    assert s["status_counts"] == {"correct": 5, "incorrect": 5, "no_answer": 1, "timeout": 1}
    assert s["truncated"] == pytest.approx(2 / 12)


def test_summarize_rejects_ragged():
    with pytest.raises(ValueError, match="same"):
        summarize([[1, 0], [1]], [["a", "b"], ["a"]], [[1, 1], [1]], [["x", "x"], ["x"]])


# ---------------------------------------------------------------- evaluate() with a scripted engine


@dataclass
class FakeScore:
    reward: float
    status: str
    extracted: str | None
    correct: bool


class AnswerLineScorer:
    """Reads the last "Answer: X" line and compares strings (the real verifier lives in bandpo.reward)."""

    def score(self, responses, answers, response_lengths):
        # run_eval passes lengths: the training scorer with overlong shaping refuses a batch without them
        assert len(response_lengths) == len(responses)
        out = []
        for text, gold in zip(responses, answers):
            m = re.findall(r"Answer:\s*(\S+)", text)
            if not m:
                out.append(FakeScore(0.0, "no_answer", None, False))
            else:
                ok = m[-1] == gold
                out.append(FakeScore(float(ok), "correct" if ok else "incorrect", m[-1], ok))
        return out

    def close(self):
        pass


class ScriptedEngine:
    """Returns fixed response texts per prompt: ``script[i][j]`` is sample j of prompt i."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_token_ids, sampling):
        self.calls.append((len(prompt_token_ids), sampling))
        prompts, responses, logprobs, index, finish = [], [], [], [], []
        for i, p in enumerate(prompt_token_ids):
            for j in range(sampling.n):
                ids = self.tokenizer(self.script[i][j], add_special_tokens=False)["input_ids"]
                prompts.append(p)
                responses.append(ids)
                logprobs.append([-1.0] * len(ids))
                index.append(i)
                finish.append("stop")
        return RolloutBatch.from_lists(prompts, responses, logprobs, index, finish, pad_id=0)

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from bandpo.models.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def two_sets():
    a = [Example("a1", "What is 1 + 1?", "2", "a"), Example("a2", "What is 2 + 2?", "4", "a")]
    b = [Example("b1", "What is 3 + 3?", "6", "b")]
    script = [
        ["Answer: 2", "Answer: 3", "Answer: 2", "no idea"],  # a1: 2/4 correct, majority "2"
        ["Answer: 5", "Answer: 5", "Answer: 4", "Answer: 1"],  # a2: 1/4, majority "5" (wrong)
        ["Answer: 6"] * 4,  # b1: 4/4
    ]
    return {"a": a, "b": b}, script


def test_evaluate_groups_rows_per_dataset(tokenizer):
    sets, script = two_sets()
    engine = ScriptedEngine(tokenizer, script)
    res = evaluate(
        engine,
        AnswerLineScorer(),
        tokenizer,
        sets,
        4,
        SamplingParams(n=99, max_tokens=8),
        "dapo",
        keep_samples=True,
    )
    assert engine.calls[0][0] == 3 and engine.calls[0][1].n == 4  # one generate call; n overrides sampling.n
    a, b = res["a"], res["b"]
    assert a["num_problems"] == 2 and a["mean@4"] == pytest.approx(3 / 8)
    assert a["pass@4"] == 1.0 and a["maj@4"] == pytest.approx(0.5)
    assert a["status_counts"] == {"correct": 3, "incorrect": 4, "no_answer": 1}
    assert b["mean@4"] == 1.0 and b["maj@4"] == 1.0 and b["std"] == 0.0
    assert a["samples"][0]["id"] == "a1" and a["samples"][0]["correct"] == [True, False, True, False]
    assert a["dropped_overlong"] == 0 and a["truncated"] == 0.0


def test_evaluate_with_the_real_verifier(tokenizer):
    from bandpo.reward import RewardScorer

    sets, script = two_sets()
    script[0][1] = "so the answer is\nAnswer: 002"  # leading zeros: still 2
    with RewardScorer(answer_format="dapo", num_workers=1) as scorer:
        res = evaluate(
            ScriptedEngine(tokenizer, script), scorer, tokenizer, sets, 4, SamplingParams(), "dapo"
        )
    assert res["a"]["mean@4"] == pytest.approx(4 / 8) and res["a"]["maj@4"] == pytest.approx(0.5)
    assert res["a"]["status_counts"] == {"correct": 4, "incorrect": 3, "no_answer": 1}
    assert res["b"]["mean@4"] == 1.0


def test_run_eval_flat_keys(tokenizer):
    sets, script = two_sets()
    flat = run_eval(
        ScriptedEngine(tokenizer, script),
        AnswerLineScorer(),
        tokenizer,
        sets,
        to_eval_config({"n": 4, "max_tokens": 8, "template": "boxed"}),
    )
    assert flat["eval/a/mean@4"] == pytest.approx(3 / 8)
    assert flat["eval/b/pass@1"] == 1.0
    for key in (
        "eval/a/std",
        "eval/a/pass@2",
        "eval/a/maj@4",
        "eval/a/response_length",
        "eval/a/truncated",
        "eval/a/num_problems",
        "eval/a/status_frac/no_answer",
    ):
        assert key in flat
    assert all(isinstance(v, float) for v in flat.values())
    with pytest.raises(Exception, match="bogus"):
        to_eval_config({"bogus": 1})


def test_table_and_plot(tokenizer, tmp_path):
    sets, script = two_sets()
    res = evaluate(
        ScriptedEngine(tokenizer, script), AnswerLineScorer(), tokenizer, sets, 4, SamplingParams(), "dapo"
    )
    table = markdown_table(res)
    lines = table.splitlines()
    assert lines[0].startswith(
        "| dataset | problems | mean@4 (%) | std (%) | pass@1 (%) | pass@2 (%) | pass@4 (%)"
    )
    assert lines[2].startswith("| a | 2 | 37.50 |") and lines[3].startswith("| b | 1 | 100.00 |")
    png = plot_pass_at_k(res, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert flatten_metrics(res)["eval/b/maj@4"] == 1.0


# ---------------------------------------------------------------- CLI config


def test_cli_config_overrides():
    cfg = load_cli_config(
        [
            "checkpoint=/m",
            "eval.datasets=[amc23,aime24]",
            "eval.n=8",
            "eval.max_tokens=64",
            "eval.paths=/data/eval",
            "--out",
            "/tmp/o",
            "eval.engine.gpu_memory_utilization=0.2",
        ]
    )
    assert cfg.checkpoint == "/m" and cfg.eval.datasets == ["amc23", "aime24"] and cfg.eval.n == 8
    assert cfg.eval.out == "/tmp/o" and cfg.eval.engine == {"gpu_memory_utilization": 0.2}
    # the paper's protocol
    assert (cfg.eval.temperature, cfg.eval.top_p, cfg.eval.template) == (1.0, 1.0, "dapo")


@pytest.mark.parametrize(
    "argv,match",
    [
        (["eval.n=4"], "checkpoint"),
        (["checkpoint=/m", "eval.nope=1"], "nope"),
        (["checkpoint=/m", "eval.n=0"], "eval.n"),
        (["checkpoint=/m", "eval.template=weird"], "eval.template"),
        (["checkpoint=/m", "eval.n=4", "eval.pass_ks=[8]"], "pass_ks"),
        (["checkpoint=/m", "positional"], "key=value"),
        (["checkpoint=/m", "eval.limit=0"], "eval.limit"),
    ],
)
def test_cli_config_errors_name_the_key(argv, match):
    with pytest.raises(Exception, match=match):
        load_cli_config(argv)


def test_trainer_eval_group_is_accepted():
    """The training config's eval section, resolved at compose, must fit ``EvalConfig``."""
    from bandpo.config import compose
    from bandpo.eval.evaluate import to_eval_config

    cfg = compose(["model=qwen2.5-3b", "data=dapo_math"])
    ev = to_eval_config(cfg.eval)  # the section itself, as the trainer passes it
    assert ev.datasets == ["amc23", "aime24", "aime25"] and ev.max_tokens == cfg.rollout.max_tokens
    assert ev.template == cfg.data.template


def test_hf_folder_of_a_checkpoint(tmp_path):
    (tmp_path / "step_10" / "hf").mkdir(parents=True)
    (tmp_path / "step_10" / "hf" / "config.json").write_text("{}")
    assert find_hf_folder(tmp_path / "step_10") == tmp_path / "step_10" / "hf"
    assert find_hf_folder(tmp_path) is None
    assert [t.hf_path for t in resolve_targets(str(tmp_path / "step_10"))] == [
        str(tmp_path / "step_10" / "hf")
    ]
    assert [t.hf_path for t in resolve_targets("Qwen/Qwen2.5-3B-Instruct")] == ["Qwen/Qwen2.5-3B-Instruct"]
    with pytest.raises(EvalUsageError, match="config.json"):
        resolve_targets(str(tmp_path))


def _config_copy(src: str, dst, **changes):
    """``src``'s config.json in ``dst`` with ``changes`` (None removes a key): all AutoConfig reads."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_eval_engine_takes_the_checkpoints_dtype_unless_given(tiny_model_dir, tmp_path):
    from bandpo.errors import InputError
    from bandpo.eval.cli import engine_kwargs

    # vLLM's own "auto" would load this float32 model in bf16
    assert engine_kwargs({}, tiny_model_dir) == {"dtype": "float32"}
    assert engine_kwargs(
        {"enforce_eager": True}, _config_copy(tiny_model_dir, tmp_path / "b", dtype="bfloat16")
    ) == {"enforce_eager": True, "dtype": "bfloat16"}
    assert engine_kwargs({"dtype": "bfloat16"}, str(tmp_path / "absent")) == {"dtype": "bfloat16"}  # not read
    with pytest.raises(
        InputError, match=r"eval\.engine\.dtype: the config of .* names no dtype; .*eval\.engine\.dtype="
    ):
        engine_kwargs({}, _config_copy(tiny_model_dir, tmp_path / "none", dtype=None))
