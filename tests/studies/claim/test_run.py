"""The runner's keeping of a finished run's records (the training itself is scripts/train.sh's)."""

from __future__ import annotations

import json

import pytest

from studies.claim.design import LEARN, RANDOM, overrides
from studies.claim.run import keep, write_heldout


def _finished_run(folder, texts: str = '{"text": "a"}\n'):
    (folder / "probe").mkdir(parents=True)
    (folder / "probe" / "texts.jsonl").write_text(texts)
    (folder / "metrics.jsonl").write_text('{"step": 0}\n')
    (folder / "config.yaml").write_text("trainer: {seed: 0}\n")
    return folder


def test_keep_makes_a_fresh_records_folder_and_writes_run_json_last(tmp_path):
    run = _finished_run(tmp_path / "runs" / "grpo-s0")
    records = tmp_path / "records"  # does not exist yet: the first run's keep makes it
    dest = records / "random" / "grpo-s0"
    keep(run, dest, {"arm": "grpo"})
    assert (records / "random" / "probe-texts.jsonl").read_text() == '{"text": "a"}\n'
    assert (dest / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert json.loads((dest / "run.json").read_text())["arm"] == "grpo"


def test_keep_refuses_probe_texts_that_differ_from_the_kept_ones(tmp_path):
    records = tmp_path / "records"
    keep(_finished_run(tmp_path / "a"), records / "random" / "grpo-s0", {})
    other = _finished_run(tmp_path / "b", texts='{"text": "b"}\n')
    with pytest.raises(SystemExit, match="differs from"):
        keep(other, records / "random" / "bandpo-s0", {})
    assert not (records / "random" / "bandpo-s0" / "run.json").exists()
    # another test probes other prompts: its texts are kept beside its own runs
    keep(other, records / "learn" / "grpo-s0", {})
    assert (records / "learn" / "probe-texts.jsonl").read_text() == '{"text": "b"}\n'


def test_learn_evaluates_and_probes_its_own_held_out_file_written_before_its_runs(tmp_path):
    path = write_heldout(LEARN.heldout, tmp_path / "learn")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 200 and {r["kind"] for r in rows} == {"add", "sub", "mul"}
    assert all("-test-" in r["id"] for r in rows)  # the test split: no key shared with a training problem
    assert write_heldout(LEARN.heldout, tmp_path / "learn").read_text() == path.read_text()  # seeded
    ov = overrides(LEARN, "grpo", 0, str(path))
    assert f"eval.datasets=[{path}]" in ov and "trainer.total_steps=40" in ov
    with pytest.raises(ValueError, match="its own held-out set"):
        overrides(LEARN, "grpo", 0)
    assert not any(o.startswith("eval.datasets") for o in overrides(RANDOM, "grpo", 0))
