"""Checkpoints through the DeepSpeed actor: the consolidated checkpoint equals the HF export, and
evaluating every kept step of a run with one engine. Target resolution and the CLI's errors are
in tests/unit/eval/test_eval_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bandpo.checkpoint.run_folders import CheckpointManager
from bandpo.eval.targets import materialize, resolve_targets

pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
    actor.update(make_train_batch(actor, 8, seed=5), BANDPO)  # weights now differ from the base model
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
        logits = {
            p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()(input_ids=ids).logits
            for p in (path, str(target.step_dir / "hf"), str(run / "hf"))
        }
        # training moved them
        assert (logits[str(run / "hf")] - base(input_ids=ids).logits).abs().max() > 1e-3
    for p in (path, str(target.step_dir / "hf")):
        torch.testing.assert_close(logits[p], logits[str(run / "hf")], atol=1e-6, rtol=0)


def test_eval_all_steps_of_a_run(tiny_model_dir, tmp_path, capsys):
    """Two training checkpoints of one run, evaluated with one vLLM engine (weights reloaded for step 2)."""
    from bandpo.eval.cli import main
    from tests.helpers.actor import BANDPO, make_train_batch, new_actor

    actor = new_actor(tiny_model_dir, lr=1e-2)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"model:\n  path: {tiny_model_dir}\n")
    manager = CheckpointManager(run / "checkpoints")
    for step in (1, 2):
        actor.update(make_train_batch(actor, 8, seed=step), BANDPO)
        manager.save(step, lambda p: actor.save_checkpoint(str(p)), {"step": step})
    data = tmp_path / "tiny5.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
            for i in range(5)
        )
    )
    payload = main(
        [
            f"checkpoint={run}",
            "steps=all",
            f"eval.paths=[{data}]",
            "eval.n=2",
            "eval.max_tokens=8",
            "cache=temp",
            "eval.engine.gpu_memory_utilization=0.2",
        ]
    )
    assert [s["step"] for s in payload["steps"]] == [1, 2]
    assert all(s["results"]["tiny5"]["num_problems"] == 5 for s in payload["steps"])
    table = (run / "eval_steps_dapo_n2.md").read_text()
    assert "| 1 | tiny5 |" in table and "| 2 | tiny5 |" in table and table.strip() in capsys.readouterr().out
    assert (run / "eval_steps_dapo_n2.png").stat().st_size > 0
    assert json.loads((run / "eval" / "step_000002" / "eval_dapo_n2.json").read_text())["step"] == 2
    assert not (run / "checkpoints" / "step_000001" / "hf").exists()  # cache=temp leaves no copy beside
