"""Datasets (hub-id registry, local files, bad rows), prompt templates and the resumable sampler."""

from __future__ import annotations

import json
import logging

import pytest

from bandpo.data import prompts
from bandpo.data.datasets import (
    REGISTRY,
    _resolve_spec,
    dataset_names,
    load_eval_sets,
    load_examples,
    load_local,
    load_many,
    load_source,
)
from bandpo.data.prompts import encode_examples, format_user_message, render_prompt, render_prompt_text
from bandpo.data.rows import examples_from_rows
from bandpo.data.sampler import EpochSampler
from bandpo.errors import InputError

PAPER_DAPO = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "What is 1+1?"
    '\n\nRemember to put your answer on its own line after "Answer:".'
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from bandpo.models.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


# ---------------------------------------------------------------- templates


def test_dapo_template_is_the_paper_text():
    assert format_user_message("What is 1+1?", "dapo") == PAPER_DAPO


def test_boxed_template_text():
    assert format_user_message("What is 1+1?", "boxed") == (
        "What is 1+1?\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    )


def test_custom_template_keeps_braces_in_problem():
    assert format_user_message("f(x)={x^2}", "Q: {problem}\nA:") == "Q: f(x)={x^2}\nA:"


def test_unknown_template_names_the_choices():
    with pytest.raises(ValueError, match="boxed.*dapo"):
        format_user_message("x", "nope")


def test_render_through_chat_template(tokenizer):
    text = render_prompt_text(tokenizer, "What is 1+1?", "dapo")
    assert text == f"<|im_start|>user\n{PAPER_DAPO}<|im_end|>\n<|im_start|>assistant\n"
    ids = render_prompt(tokenizer, "What is 1+1?", "dapo")
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text


def test_render_with_system_prompt(tokenizer):
    text = render_prompt_text(tokenizer, "2+2?", "boxed", system_prompt="Be brief.")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?")


def test_render_plain_text_without_chat_template(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    assert render_prompt_text(plain, "What is 1+1?", "dapo") == PAPER_DAPO
    assert plain.decode(render_prompt(plain, "What is 1+1?", "dapo")) == PAPER_DAPO


def test_encode_examples_filters_overlong(tokenizer, caplog):
    from bandpo.types import Example

    exs = [
        Example("short", "1+1?", "2", "t"),
        Example("long", "7 * 8 " * 200, "56", "t"),
        Example("b", "2+2?", "4", "t"),
    ]
    limit = len(render_prompt(tokenizer, "1+1?", "dapo")) + 5
    with caplog.at_level(logging.WARNING):
        enc = encode_examples(tokenizer, exs, "dapo", max_prompt_len=limit)
    assert [e.id for e in enc.examples] == ["short", "b"]
    assert enc.dropped_ids == ["long"]
    assert len(enc.prompt_ids) == 2 and all(len(p) <= limit for p in enc.prompt_ids)
    assert "dropped 1 of 3" in caplog.text and "long" in caplog.text
    assert len(encode_examples(tokenizer, exs, "dapo").examples) == 3  # no limit: keep all


def test_strip_instruction_roundtrip():
    assert prompts.strip_instruction(format_user_message("Find x.", "dapo")) == "Find x."
    assert prompts.strip_instruction(format_user_message("Find x.", "boxed")) == "Find x."
    assert prompts.strip_instruction("Find x.") == "Find x."


# ---------------------------------------------------------------- local files and bad rows


def test_local_jsonl_skips_and_counts_bad_rows(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "set.jsonl",
        [
            {"id": "ok1", "problem": "1+1?", "answer": "2"},
            {"id": "no_answer", "problem": "2+2?"},
            {"id": "empty_problem", "problem": "  ", "answer": "3"},
            {"id": "null_answer", "problem": "3+3?", "answer": None},
            {"problem": "", "answer": "5"},  # no id: reported by row index
            {"id": "ok2", "problem": "4+4?", "answer": 8},
        ],
    )
    with caplog.at_level(logging.WARNING):
        exs = load_local(path)
    assert [(e.id, e.problem, e.answer, e.source) for e in exs] == [
        ("ok1", "1+1?", "2", "set"),
        ("ok2", "4+4?", "8", "set"),
    ]
    assert "skipped 4 row(s)" in caplog.text
    for bad in ("no_answer", "empty_problem", "null_answer", "set-4"):
        assert bad in caplog.text


def test_skipped_ids_logged_are_capped(tmp_path, caplog):
    rows = [{"id": f"bad{i}", "problem": "", "answer": "1"} for i in range(9)] + [
        {"id": "ok", "problem": "p", "answer": "1"}
    ]
    with caplog.at_level(logging.WARNING):
        exs = load_local(write_jsonl(tmp_path / "x.jsonl", rows))
    assert len(exs) == 1 and "skipped 9 row(s)" in caplog.text
    assert "bad4" in caplog.text and "bad5" not in caplog.text


def test_custom_keys_and_wrong_key_error(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+3?", "final": "5", "uid": 7}])
    [ex] = load_examples(str(path), problem_key="question", answer_key="final", id_key="uid")
    assert (ex.id, ex.problem, ex.answer) == ("7", "2+3?", "5")
    with pytest.raises(InputError, match=r"q.jsonl.*'problem'.*\['question', 'final', 'uid'\]"):
        load_examples(str(path))


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{not json\n')
    with pytest.raises(InputError, match=r"broken.jsonl:2: invalid JSON"):
        load_local(path)


def test_missing_file():
    with pytest.raises(InputError, match="dataset file not found: /nonexistent/nowhere.jsonl"):
        load_examples("/nonexistent/nowhere.jsonl")


def test_parquet_with_nested_dapo_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    wrapped = format_user_message("Compute 6*7.", "dapo")
    rows = [
        {
            "prompt": [{"role": "user", "content": wrapped}],
            "reward_model": {"ground_truth": "42", "style": "rule"},
            "extra_info": {"index": "a1"},
        },
        {
            "prompt": [{"role": "user", "content": wrapped}],
            "reward_model": {"ground_truth": "42", "style": "rule"},
            "extra_info": {"index": "a2"},
        },  # a duplicate, as in the raw DAPO set
        {
            "prompt": [{"role": "user", "content": "Compute 2*3."}],
            "reward_model": {"ground_truth": "", "style": "rule"},
            "extra_info": {"index": "a3"},
        },
    ]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    exs = load_local(
        path,
        problem_key="prompt",
        answer_key="reward_model.ground_truth",
        id_key="extra_info.index",
        dedup=True,
    )
    assert [(e.id, e.problem, e.answer) for e in exs] == [("a1", "Compute 6*7.", "42")]


def test_answer_normalisation_and_level_filter():
    rows = [
        {"problem": "p1", "answer": 27.0, "level": 3},
        {"problem": "p2", "answer": "\\boxed{204}", "level": "Level 5"},
        {"problem": "p3", "answer": "1/2", "level": "Level 2"},
        {"problem": "p4", "answer": "025", "level": "Level ?"},
    ]
    exs = examples_from_rows(rows, source="s", where="mem", levels=(3, 4, 5))
    assert [(e.problem, e.answer) for e in exs] == [("p1", "27"), ("p2", "204")]
    assert [e.answer for e in examples_from_rows(rows, source="s", where="mem")] == [
        "27",
        "204",
        "1/2",
        "025",
    ]


def test_limit(tmp_path):
    path = write_jsonl(tmp_path / "l.jsonl", [{"problem": f"p{i}", "answer": str(i)} for i in range(5)])
    assert [e.answer for e in load_examples(str(path), limit=2)] == ["0", "1"]


# ---------------------------------------------------------------- registry and eval sets


def test_registry_names_and_hub_ids():
    for name in ("amc23", "aime24", "aime25", "math500", "dapo17k", "dapo17k_processed", "math_l3to5"):
        assert name in dataset_names()
    assert REGISTRY["math_l3to5"].levels == (3, 4, 5) and REGISTRY["math_l3to5"].split == "train"
    assert _resolve_spec("math-ai/amc23").problem_key == "question"
    # the bare id is the whole train split
    assert _resolve_spec("nlile/hendrycks-MATH-benchmark").levels is None
    assert _resolve_spec("someone/other-set").hub_id == "someone/other-set"


def test_hub_loader_on_a_local_dataset_folder(tmp_path, monkeypatch):
    """load_hub goes through datasets.load_dataset; a local folder in the hub layout stands in for the hub."""
    import dataclasses

    from bandpo.data.datasets import load_hub

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    amc = tmp_path / "amc23"
    amc.mkdir()
    write_jsonl(
        amc / "test.jsonl",
        [
            {"id": 0, "question": "q0", "answer": 27.0, "url": "u"},
            {"id": 1, "question": "", "answer": 3.0, "url": "u"},
        ],
    )
    spec = dataclasses.replace(REGISTRY["amc23"], hub_id=str(amc))
    assert [(e.id, e.problem, e.answer) for e in load_hub(spec, cache_dir=str(tmp_path / "cache"))] == [
        ("0", "q0", "27")
    ]
    math = tmp_path / "math"
    math.mkdir()
    write_jsonl(
        math / "train.jsonl",
        [
            {
                "problem": f"p{lvl}",
                "solution": "s",
                "answer": str(lvl),
                "subject": "Algebra",
                "level": lvl,
                "unique_id": f"train/algebra/{lvl}.json",
            }
            for lvl in range(1, 6)
        ],
    )
    spec = dataclasses.replace(REGISTRY["math_l3to5"], hub_id=str(math))
    exs = load_hub(spec, cache_dir=str(tmp_path / "cache"))
    assert [(e.id, e.answer) for e in exs] == [(f"train/algebra/{lvl}.json", str(lvl)) for lvl in (3, 4, 5)]


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown dataset 'aime23'.*aime24.*amc23"):
        load_examples("aime23")


def test_load_eval_sets_from_dir_files_and_mapping(tmp_path):
    for name in ("amc23", "aime24"):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"id": f"{name}-1", "problem": "p", "answer": "1"}])
    by_dir = load_eval_sets(["amc23", "aime24"], str(tmp_path))
    assert list(by_dir) == ["amc23", "aime24"] and by_dir["aime24"][0].id == "aime24-1"
    by_files = load_eval_sets(None, [str(tmp_path / "aime24.jsonl")])
    assert list(by_files) == ["aime24"]
    by_map = load_eval_sets(None, {"x": str(tmp_path / "amc23.jsonl")})
    assert by_map["x"][0].id == "amc23-1"
    with pytest.raises(InputError, match=r"^eval.paths: no aime25.jsonl.*amc23.jsonl"):
        load_eval_sets(["aime25"], str(tmp_path))
    with pytest.raises(InputError, match=r"^eval.paths.x: dataset file not found: .*nowhere.jsonl"):
        load_eval_sets(None, {"x": str(tmp_path / "nowhere.jsonl")})


def test_load_eval_sets_mapping_overrides_some_names(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a-1", "problem": "p", "answer": "1"}])
    sets = load_eval_sets(["tiny_arith_test", "mine"], {"mine": str(tmp_path / "a.jsonl")}, limit=3)
    assert list(sets) == ["tiny_arith_test", "mine"]
    assert len(sets["tiny_arith_test"]) == 3 and sets["mine"][0].id == "a-1"
    # empty paths: by name
    assert list(load_eval_sets(["tiny_arith_test"], {}, limit=1)) == ["tiny_arith_test"]


def test_generated_tiny_arith_sets():
    test = load_examples("tiny_arith_test")
    assert len(test) == 200 and all(e.answer.isdigit() and e.source == "tiny_arith_test" for e in test)
    small = load_examples("tiny_arith", split="train", size=8, seed=1)
    assert len(small) == 8 and small == load_examples("tiny_arith", size=8, seed=1)
    assert not {e.problem for e in test} & {e.problem for e in load_examples("tiny_arith", size=300)}
    with pytest.raises(ValueError, match="generated"):
        load_examples("amc23", size=10)


def test_a_generated_set_s_options_choose_its_problems():
    """tiny_arith's kinds and difficulty from a data source reach its generator: the rows are make_split's."""
    from bandpo.data.tiny_arith_problems import make_split

    entry = {"name": "tiny_arith", "size": 40, "kinds": ["add", "sub", "mul"], "difficulty": 2}
    rows = make_split("train", 40, 0, difficulty=2, kinds=("add", "sub", "mul"))
    got = load_source(entry)
    assert [(e.problem, e.answer) for e in got] == [(r["problem"], r["answer"]) for r in rows]
    assert {r["kind"] for r in rows} == {"add", "sub", "mul"}
    assert max(int(n) for e in got for n in e.problem.rstrip("?").split() if n.isdigit()) >= 10
    assert [e.problem for e in load_source({"name": "tiny_arith", "size": 40})] != [e.problem for e in got]
    with pytest.raises(InputError, match="only 131 distinct train problems"):
        load_source({"name": "tiny_arith", "size": 500, "kinds": ["add", "sub", "mul"], "difficulty": 1})
    with pytest.raises(InputError, match="kinds must be a non-empty subset"):
        load_source({"name": "tiny_arith", "kinds": ["div"]})
    with pytest.raises(InputError, match="apply only to generated sets"):
        load_source({"name": "amc23", "difficulty": 2})


def test_the_train_split_s_halves_partition_it_by_key():
    """warm and rl: each the whole split's rows of its half in the whole split's order, between them every
    row, owned by part_of of the canonical key (so a word problem and the sum it spells share a half)."""
    from bandpo.data.tiny_arith_problems import _key, make_split, part_of

    whole = [(r["kind"], r["problem"]) for r in make_split("train", 2000, 0)]
    at = {x: i for i, x in enumerate(whole)}
    halves = {p: make_split("train", 800, 0, part=p) for p in ("warm", "rl")}
    seen = {p: [at[(r["kind"], r["problem"])] for r in rows] for p, rows in halves.items()}
    assert all(pos == sorted(pos) for pos in seen.values())  # the whole split's order
    assert not set(seen["warm"]) & set(seen["rl"])
    end = min(pos[-1] for pos in seen.values())
    assert sorted(i for pos in seen.values() for i in pos if i <= end) == list(
        range(end + 1)
    )  # no row skipped
    for p, rows in halves.items():
        for r in rows:
            step, *more = r["solution"].splitlines()[:-1]
            if not more:  # one operation: the canonical key from the solution's line "a+b=c"
                lhs = step.split("=")[0]
                op = next(c for c in "+-*" if c in lhs)
                a, b = (int(v) for v in lhs.split(op))
                assert part_of(_key(a, op, b)) == p
        assert {r["kind"] for r in rows} == {"add", "sub", "mul", "two_step", "word"}
    assert halves["warm"][0]["id"] == "tiny_arith-train-warm-0-00000"
    # through a data source; refused on the test split and by another name
    got = load_source({"name": "tiny_arith", "size": 5, "part": "rl"})
    assert [e.problem for e in got] == [r["problem"] for r in halves["rl"][:5]]
    with pytest.raises(InputError, match="part must be one of"):
        load_source({"name": "tiny_arith_test", "part": "warm"})
    with pytest.raises(InputError, match="part must be one of"):
        load_source({"name": "tiny_arith", "part": "half"})


def test_load_source_entries(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"q": "1+2?", "a": "3"}, {"q": "2+2?", "a": "4"}])
    assert len(load_source({"name": "tiny_arith", "split": "train", "size": 5})) == 5
    [ex] = load_source({"path": str(path), "problem_key": "q", "answer_key": "a", "limit": 1})
    assert (ex.problem, ex.answer) == ("1+2?", "3")
    assert len(load_source(str(path), problem_key="q", answer_key="a")) == 2
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sise'\]"):
        load_source({"name": "tiny_arith", "sise": 5})
    with pytest.raises(InputError, match="tiny_arith is generated, not read from a file"):
        load_source({"name": "tiny_arith", "path": str(path)})
    with pytest.raises(InputError, match="give 'name', 'path' or both"):
        load_source({"problem_key": "q"})
    mixed = load_many(
        [{"name": "tiny_arith", "size": 3}, {"path": str(path), "problem_key": "q", "answer_key": "a"}]
    )
    assert [e.source for e in mixed] == ["tiny_arith"] * 3 + ["t"] * 2


# ---------------------------------------------------------------- sampler


def test_sampler_epochs_are_permutations_and_deterministic():
    a, b = EpochSampler(10, seed=3), EpochSampler(10, seed=3)
    first = [a.next_batch(5) + a.next_batch(5) for _ in range(3)]
    assert [sorted(e) for e in first] == [list(range(10))] * 3
    assert first[0] != first[1]  # reshuffled per epoch
    assert [b.next_batch(10) for _ in range(3)] == first
    assert EpochSampler(10, seed=4).next_batch(10) != first[0]
    assert EpochSampler(10, shuffle=False).next_batch(4) == [0, 1, 2, 3]


def test_sampler_batches_cross_epochs_without_drop_last():
    s = EpochSampler(5, seed=0)
    order0, order1 = list(s.order(0)), list(s.order(1))
    assert s.next_batch(3) == order0[:3]
    assert s.next_batch(3) == order0[3:] + order1[:1]
    assert (s.epoch, s.cursor, s.consumed) == (1, 1, 6)


def test_sampler_drop_last_skips_short_tail():
    s = EpochSampler(5, seed=0, drop_last=True)
    assert s.next_batch(2) == list(s.order(0)[:2])
    s.next_batch(2)
    assert s.next_batch(2) == list(s.order(1)[:2])
    assert s.batches_per_epoch(2) == 2 and EpochSampler(5).batches_per_epoch(2) == 3
    with pytest.raises(ValueError, match="exceeds"):
        s.next_batch(6)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_resumes_exactly(drop_last):
    ref = EpochSampler(13, seed=7, drop_last=drop_last)
    stream = [ref.next_batch(4) for _ in range(12)]
    run = EpochSampler(13, seed=7, drop_last=drop_last)
    for _ in range(5):
        run.next_batch(4)
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    resumed = EpochSampler(13, seed=7, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(4) for _ in range(7)] == stream[5:]


def test_sampler_state_mismatch_is_an_error():
    state = EpochSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_examples"):
        EpochSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        EpochSampler(10, seed=2).load_state_dict(state)
