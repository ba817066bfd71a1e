"""Evaluating training checkpoints: target resolution, DeepSpeed consolidation == hf/ export, CLI errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bandpo.eval.targets import EvalUsageError, materialize, resolve_targets
from bandpo.run.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[3]


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
    for kwargs, match in [({"step": 5}, "kept steps: 4, 8, 12"), ({"steps": "some"}, "expected 'all'"),
                          ({"steps": [3]}, r"no checkpoint for \[3\]")]:
        with pytest.raises(EvalUsageError, match=match):
            resolve_targets(str(run), **kwargs)
    with pytest.raises(EvalUsageError, match="need a run folder"):
        resolve_targets(str(ck / "step_4"), step=4)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_consolidated_checkpoint_equals_hf_export(tiny_model_dir, tmp_path, zero_stage):
    """DeepSpeed's zero_to_fp32 merge of a step folder gives the weights export_hf writes for that step.

    Both are fp32 on CPU and copy the same master weights, so the logits agree to fp32 rounding of
    identical arithmetic: the 1e-6 bound (logits are O(1)) would catch any weight off by one ulp-scale
    step in a shard boundary, and a wrong or missing shard would be off by O(0.01).
    """
    from transformers import AutoModelForCausalLM

    from tests.helpers.actor import BANDPO, make_rollout, make_train_batch, new_actor

    actor = new_actor(tiny_model_dir, zero_stage=zero_stage, lr=1e-2)
    actor.update(make_train_batch(actor, 8, seed=5), dict(BANDPO))  # weights now differ from the base model
    run = tmp_path / "runs" / f"z{zero_stage}"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"model:\n  path: {tiny_model_dir}\n")
    CheckpointManager(run / "checkpoints").save(3, lambda p: actor.save_checkpoint(str(p)), {"step": 3})
    actor.export_hf(str(run / "hf"))

    (target,) = resolve_targets(str(run))
    assert target.step == 3
    path = materialize(target, base_model=None, cache="temp", temp_root=tmp_path / "tmp")
    assert Path(path).parent == tmp_path / "tmp" and not (target.step_dir / "hf").exists()
    assert materialize(target, base_model=None, cache="beside", temp_root=None) == str(target.step_dir / "hf")

    ids = make_rollout(2, 0).response_ids
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = {p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(input_ids=ids).logits
                  for p in (path, str(target.step_dir / "hf"), str(run / "hf"))}
        assert (logits[str(run / "hf")] - base(input_ids=ids).logits).abs().max() > 1e-3  # training moved them
    for p in (path, str(target.step_dir / "hf")):
        torch.testing.assert_close(logits[p], logits[str(run / "hf")], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- CLI errors: exit 2, one line, no traceback

def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "bandpo.eval", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _cases(tmp_path: Path):
    run = fake_run(tmp_path)
    (tmp_path / "empty").mkdir()
    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    return [
        (["checkpoint=runs/nope", "eval.datasets=[amc23]"], "checkpoint not found: runs/nope"),
        ([f"checkpoint={tmp_path / 'empty'}"], "neither Hugging Face weights"),
        ([f"checkpoint={hf}", "eval.datasets=[no_such_set]"], "unknown dataset 'no_such_set'"),
        ([f"checkpoint={hf}", "eval.nope=1"], "bad override"),
        ([f"checkpoint={run}", "step=5"], "kept steps: 4, 8, 12"),
        ([f"checkpoint={run / 'checkpoints' / 'step_9'}"], "kept steps there: 4, 8, 12"),
    ]


def test_cli_user_errors_exit_2_with_one_line(tmp_path):
    """Each case fails before any engine starts (~3 s each, mostly importing torch)."""
    for argv, expected in _cases(tmp_path):
        proc = _run_cli(*argv, cwd=tmp_path)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and len(err) == 1 and err[0].startswith("eval: error:"), (argv, err)
        assert expected in err[0], (argv, err)


# ---------------------------------------------------------------- end to end: every kept step, one engine

@pytest.mark.integration
def test_eval_all_steps_of_a_run(tiny_model_dir, tmp_path, capsys):
    """Two training checkpoints of one run, evaluated with one vLLM engine (weights reloaded for step 2)."""
    from bandpo.eval.evaluate import main
    from tests.helpers.actor import BANDPO, make_train_batch, new_actor

    actor = new_actor(tiny_model_dir, lr=1e-2)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"model:\n  path: {tiny_model_dir}\n")
    manager = CheckpointManager(run / "checkpoints")
    for step in (1, 2):
        actor.update(make_train_batch(actor, 8, seed=step), dict(BANDPO))
        manager.save(step, lambda p: actor.save_checkpoint(str(p)), {"step": step})
    data = tmp_path / "tiny5.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(5)))
    payload = main([f"checkpoint={run}", "steps=all", f"eval.paths=[{data}]", "eval.n=2", "eval.max_tokens=8",
                    "cache=temp", "eval.engine.gpu_memory_utilization=0.2"])
    assert [s["step"] for s in payload["steps"]] == [1, 2]
    assert all(s["results"]["tiny5"]["num_problems"] == 5 for s in payload["steps"])
    table = (run / "eval_steps_dapo_n2.md").read_text()
    assert "| 1 | tiny5 |" in table and "| 2 | tiny5 |" in table and table.strip() in capsys.readouterr().out
    assert (run / "eval_steps_dapo_n2.png").stat().st_size > 0
    assert json.loads((run / "eval" / "step_000002" / "eval_dapo_n2.json").read_text())["step"] == 2
    assert not (run / "checkpoints" / "step_000001" / "hf").exists()  # cache=temp leaves no copy beside
