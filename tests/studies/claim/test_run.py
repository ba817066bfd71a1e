"""The runner's keeping of a finished run's records (the training itself is scripts/train.sh's)."""

from __future__ import annotations

import json

import pytest

from studies.claim.run import keep


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
    keep(run, dest, {"arm": "grpo"}, records)
    assert (records / "probe-texts.jsonl").read_text() == '{"text": "a"}\n'
    assert (dest / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert json.loads((dest / "run.json").read_text())["arm"] == "grpo"


def test_keep_refuses_probe_texts_that_differ_from_the_kept_ones(tmp_path):
    records = tmp_path / "records"
    keep(_finished_run(tmp_path / "a"), records / "random" / "grpo-s0", {}, records)
    other = _finished_run(tmp_path / "b", texts='{"text": "b"}\n')
    with pytest.raises(SystemExit, match="differs from"):
        keep(other, records / "random" / "bandpo-s0", {}, records)
    assert not (records / "random" / "bandpo-s0" / "run.json").exists()
