"""Evaluating training checkpoints: target resolution, DeepSpeed consolidation == hf/ export, CLI errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bandpo.errors import EvalUsageError
from bandpo.eval.targets import materialize, resolve_targets


def fake_run(tmp_path: Path, steps=(4, 8, 12)) -> Path:
    """A run folder layout (no weights): checkpoints/step_N/{actor/state, trainer_state.json}, latest."""
    run = tmp_path / "runs" / "r"
    for s in steps:
        d = run / "checkpoints" / f"step_{s:06d}"
        (d / "actor" / "state").mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"step": s}))
    (run / "checkpoints" / "latest").write_text(f"step_{steps[-1]:06d}")
    return run


def test_resolve_targets_forms(tmp_path):
    run = fake_run(tmp_path)
    ck = run / "checkpoints"
    assert [t.step for t in resolve_targets(str(run))] == [12]  # latest
    assert [t.step for t in resolve_targets(str(run), step=8)] == [8]
    assert [t.step for t in resolve_targets(str(run), steps="all")] == [4, 8, 12]
    assert [t.step for t in resolve_targets(str(run), steps=[12, 4])] == [4, 12]
    (t,) = resolve_targets(str(ck / "step_8"))  # typed without the zero padding
    assert t.step_dir == ck / "step_000008" and t.run_dir == run
    (hub,) = resolve_targets("Qwen/Qwen2.5-3B-Instruct")
    assert hub.hf_path == "Qwen/Qwen2.5-3B-Instruct"
    (ck / "step_000008" / "hf").mkdir()  # a cached consolidation is reused as is
    (ck / "step_000008" / "hf" / "config.json").write_text("{}")
    assert materialize(t, base_model=None, cache="beside", temp_root=None) == str(ck / "step_000008" / "hf")
    for kwargs, match in [
        ({"step": 5}, "kept steps: 4, 8, 12"),
        ({"steps": "some"}, "expected 'all'"),
        ({"steps": [3]}, r"no checkpoint for \[3\]"),
    ]:
        with pytest.raises(EvalUsageError, match=match):
            resolve_targets(str(run), **kwargs)
    with pytest.raises(EvalUsageError, match="need a run folder"):
        resolve_targets(str(ck / "step_4"), step=4)


# ---------------------------------------------------------------- CLI errors: exit 2, one line, no traceback


def _cases(tmp_path: Path):
    run = fake_run(tmp_path)
    (tmp_path / "empty").mkdir()
    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    adapter = tmp_path / "adapter"  # a PEFT LoRA folder whose base has moved
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/gone/base"}))
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "a", "problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    return [
        (["checkpoint=runs/nope", "eval.datasets=[amc23]"], "checkpoint not found: runs/nope"),
        ([f"checkpoint={tmp_path / 'empty'}"], "neither Hugging Face weights"),
        ([f"checkpoint={hf}", "eval.datasets=[no_such_set]"], "unknown dataset 'no_such_set'"),
        ([f"checkpoint={hf}", "eval.nope=1"], "bad override"),
        ([f"checkpoint={run}", "step=5"], "kept steps: 4, 8, 12"),
        ([f"checkpoint={run / 'checkpoints' / 'step_9'}"], "kept steps there: 4, 8, 12"),
        ([f"checkpoint={adapter}", f"eval.paths=[{data}]"], "base model /gone/base (base_model_name_or_path"),
    ]


def test_cli_user_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    """Each case fails before any engine starts: exit 2 and one line on stderr. The cases run the CLI's
    ``main`` in this process; the entry point's wiring and the absence of a traceback are checked end to
    end by the real command in tests/unit/data/test_inputs.py::test_eval_hub_set_offline_is_one_error_line_and_exit_2."""
    from bandpo.eval.cli import main

    cases = _cases(tmp_path)
    monkeypatch.chdir(tmp_path)  # "runs/nope" is relative to the working directory
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2, (argv, err)
        assert len(err) == 1 and err[0].startswith("eval: error:") and expected in err[0], (argv, err)


def test_cli_refuses_a_checkpoint_holding_code_in_one_line(tmp_path, tiny_model_dir, capsys):
    """A shared run whose ZeRO shard pickles a call (here ``os.mkdir`` of a marker): the eval command
    stops before consolidating, exit 2, one line naming the file; the marker never appears."""
    import torch

    from bandpo.eval.cli import main

    class MakeDir:
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "pwned"),)

    run = fake_run(tmp_path, steps=(1,))
    (run / "config.yaml").write_text(f"model:\n  path: {tiny_model_dir}\n")
    shard = run / "checkpoints" / "step_000001" / "actor" / "state" / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "extra": MakeDir()}, shard)
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "a", "problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main([f"checkpoint={run}", f"eval.paths=[{data}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"eval: error: unsafe checkpoint: {shard} holds pickled code (posix.mkdir)"), err
    assert "bandpo refuses to run it" in err[0]
    assert not (tmp_path / "pwned").exists() and not (shard.parents[2] / "hf").exists()
