"""Test 2's pool candidates: the files the base-model evaluation reads, and the command that reads them."""

from __future__ import annotations

import json

import pytest

from studies.claim.pool import CANDIDATES, eval_command, write_candidates


def test_each_candidate_is_its_own_distinct_training_problems(tmp_path):
    files = write_candidates(tmp_path, size=8)
    assert set(files) == set(CANDIDATES)
    for name, path in files.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        _, kinds = CANDIDATES[name]
        assert len(rows) == 8 and {r["kind"] for r in rows} <= set(kinds)
        assert len({r["problem"] for r in rows}) == 8
        assert all("-train-" in r["id"] for r in rows)  # the pool's split, the one a pilot draws from


def test_level_two_candidates_hold_larger_numbers_than_level_one(tmp_path):
    files = write_candidates(tmp_path, size=16)

    def largest_answer(name):
        return max(int(json.loads(line)["answer"]) for line in files[name].read_text().splitlines())

    # level 1: one-digit operands, so a sum is at most 9 + 9 and a product 9 x 9
    assert largest_answer("l1_one_op") <= 81
    assert largest_answer("l2_add_sub") > 18


def test_the_evaluation_reads_every_file_at_the_runs_sampling_settings(tmp_path):
    files = write_candidates(tmp_path, size=2)
    cmd = eval_command(files, "/m", tmp_path / "eval")
    assert all(str(p) in cmd for p in files.values())
    for setting in ("eval.temperature=0.6", "eval.max_tokens=256", "eval.template=boxed", "dtype=float32"):
        assert setting in cmd


def test_the_learn_pool_is_one_pass_of_a_runs_draws():
    # amendment 5: all but 3 of the level-1 one-operation training problem tiny_arith has (131; 128 taken) beside 192
    # level-2 ones: 320 rows, the 40 steps x 8 prompts a run draws, so each row is drawn once
    from bandpo.data.tiny_arith_problems import make_split
    from studies.claim.design import COMMON, LEARN, LEARN_TRAIN, ONE_OP

    rows = [make_split("train", e.size, 0, difficulty=e.difficulty, kinds=e.kinds) for e in LEARN_TRAIN]
    prompts = int(next(o for o in COMMON if o.startswith("trainer.prompts_per_step=")).split("=")[1])
    assert sum(map(len, rows)) == LEARN.steps * prompts == 320
    with pytest.raises(ValueError, match="only 131 distinct train problems"):
        make_split("train", 132, 0, difficulty=1, kinds=ONE_OP)
