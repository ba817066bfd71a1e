"""studies/claim/records.py: made-up run records (``conftest.write_run``) read into typed rows, and
malformed ones refused with the file named."""

from __future__ import annotations

import json
import math

import pytest

from studies.claim.records import RecordError, read_run, read_test


def test_a_run_is_read_into_its_row(records, write_run):
    folder = write_run(
        records, "bandpo", 3, {0: 2.0, 5: 1.8, 10: 1.5, 15: 1.2, 20: 1.0}, {0: 0.25, 20: 0.375}
    )
    run = read_run(folder, 20)
    assert (run.arm, run.seed, run.name) == ("bandpo", 3, "bandpo-s3")
    assert run.probe == {0: 2.0, 5: 1.8, 10: 1.5, 15: 1.2, 20: 1.0}
    assert run.eval_key == "eval/tiny_arith_test/mean@8" and run.evals == {0: 0.25, 20: 0.375}
    # actor/entropy = 0.5 + step / 100 on steps 1..20 (write_run)
    assert sorted(run.rollout) == list(range(1, 21)) and run.rollout[20] == pytest.approx(0.7)
    assert run.machine == ("AMD EPYC 7B13", False) and run.precision == "fp32" and run.wall_s == 3000.0
    # D = ln(1.0 / 2.0) from these rows is the stats' business; the rows hold what it needs
    assert math.log(run.probe[20] / run.probe[0]) == pytest.approx(-math.log(2), abs=1e-12)


def test_rows_of_one_step_are_merged(records, write_run):
    # a final row (the trainer's end-of-run evaluation when the last step had none) adds to step 20's
    folder = write_run(records, "grpo", 0, {0: 2.0, 20: 1.5})
    with open(folder / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 20, "final": True, "eval/tiny_arith_test/mean@8": 0.5}) + "\n")
    run = read_run(folder, 20)
    assert run.probe[20] == 1.5 and run.evals == {20: 0.5}


@pytest.mark.parametrize(
    ("setting", "fast", "expected"),
    [("auto", True, "bf16"), ("auto", False, "fp32"), ("true", False, "bf16"), ("false", True, "fp32")],
)
def test_precision_is_actor_bf16_resolved_on_the_recorded_machine(
    records, write_run, setting, fast, expected
):
    folder = write_run(records, "grpo", 0, {0: 2.0, 20: 1.5}, fast_bf16=fast, bf16=setting)
    assert read_run(folder, 20).precision == expected


def test_read_test_takes_recorded_runs_only(records, write_run):
    write_run(records, "no_clip", 1, {0: 2.0, 20: 2.1})
    write_run(records, "grpo", 1, {0: 2.0, 20: 1.5})
    write_run(records, "grpo", 0, {0: 2.0, 20: 1.5})
    (records / "random" / "bandpo-s0").mkdir()  # not recorded yet: no run.json
    assert [r.name for r in read_test(records / "random", 20)] == ["grpo-s0", "grpo-s1", "no_clip-s1"]
    assert read_test(records / "nothing", 20) == []


def test_a_missing_step_0_probe_names_the_file(records, write_run):
    folder = write_run(records, "grpo", 0, {5: 2.0, 20: 1.5})
    with pytest.raises(
        RecordError, match=r"grpo-s0/metrics.jsonl: no probe/entropy in the base policy's row"
    ):
        read_run(folder, 20)


def test_a_missing_last_probe_names_the_file(records, write_run):
    folder = write_run(records, "grpo", 0, {0: 2.0, 15: 1.5})
    with pytest.raises(RecordError, match=r"grpo-s0/metrics.jsonl: no probe/entropy in step 20's row"):
        read_run(folder, 20)


def test_a_nonfinite_probe_names_the_file(records, write_run):
    # the trainer logs a non-finite number as a string
    folder = write_run(records, "grpo", 0, {0: 2.0, 20: 1.5})
    text = (folder / "metrics.jsonl").read_text().replace('"probe/entropy": 1.5', '"probe/entropy": "nan"')
    (folder / "metrics.jsonl").write_text(text)
    with pytest.raises(RecordError, match=r"metrics.jsonl: step 20: probe/entropy is 'nan'"):
        read_run(folder, 20)


def test_malformed_run_json_and_config_name_the_file(records, write_run):
    folder = write_run(records, "grpo", 0, {0: 2.0, 20: 1.5})
    (folder / "run.json").write_text('{"arm": "grpo", "seed": 0}')
    with pytest.raises(RecordError, match=r"grpo-s0/run.json: no machine"):
        read_run(folder, 20)
    (folder / "run.json").write_text("{not json")
    with pytest.raises(RecordError, match=r"grpo-s0/run.json: not JSON"):
        read_run(folder, 20)
    folder = write_run(records, "grpo", 1, {0: 2.0, 20: 1.5})
    (folder / "config.yaml").write_text("actor:\n  bf16: maybe\ntrainer:\n  device: cpu\n")
    with pytest.raises(RecordError, match=r"grpo-s1/config.yaml: no eval"):
        read_run(folder, 20)
    (folder / "metrics.jsonl").unlink()
    with pytest.raises(RecordError, match=r"grpo-s1/metrics.jsonl: missing"):
        read_run(folder, 20)


def test_a_run_json_of_another_run_is_refused(records, write_run):
    folder = write_run(records, "grpo", 0, {0: 2.0, 20: 1.5})
    info = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**info, "arm": "bandpo"}))
    with pytest.raises(RecordError, match=r"run.json: arm/seed bandpo/0 != folder grpo-s0"):
        read_run(folder, 20)


def test_a_torn_metrics_line_names_the_file_and_line(records, write_run):
    # read_metrics skips such a line; a recorded run has ended, so in its record it is damage. Lines 1-21:
    # steps 0..20 (write_run), the torn one is line 22
    folder = write_run(records, "grpo", 0, {0: 2.0, 20: 1.5})
    with open(folder / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 21, "probe/ent')
    with pytest.raises(RecordError, match=r"grpo-s0/metrics.jsonl: line 22 is not JSON"):
        read_run(folder, 20)
