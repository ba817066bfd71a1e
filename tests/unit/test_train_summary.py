"""The end-of-run summary (bandpo.train.summary): first -> last, the change in points, the reference line."""

from __future__ import annotations

import json

from bandpo.train import summary


def test_summary_gives_before_after_change_and_reference(tmp_path):
    key = "eval/tiny_arith_test/mean@32"
    rows = [
        {"step": 0, key: 0.7589},
        {"step": 1, "reward/mean": 0.5, "reward/accuracy": 0.75},
        {"step": 2, "reward/mean": 0.6, "reward/accuracy": 0.8},
        {"step": 2, "final": True, key: 0.8227},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = summary(path, 2, reference="seeds 0-2: +5.6 to +6.4")
    # (0.8227 - 0.7589) x 100 = 6.38 -> "+6.4 points"
    assert f"  {key:<34} step 0: 0.7589 -> step 2: 0.8227 (+6.4 points)" in text.splitlines()
    assert "  reward/accuracy                    step 1: 0.7500 -> step 2: 0.8000" in text.splitlines()
    assert text.splitlines()[-1] == "  reference: seeds 0-2: +5.6 to +6.4"
    assert "reference" not in summary(path, 2)


def test_reference_line_only_for_the_config_it_was_measured_with():
    from bandpo.config import compose
    from bandpo.train import reference_result

    default = compose([])
    assert reference_result(default) == default.trainer.reference_result
    # seeds and where the run writes do not change what the reference describes
    assert (
        reference_result(compose(["trainer.seed=2", "trainer.output_dir=/tmp/x"]))
        == default.trainer.reference_result
    )
    # another model (its own config sets no reference), another step count, or the tiny config with
    # another model folder: the number does not describe the run
    assert reference_result(compose(["model=smollm2-135m"])) is None
    assert reference_result(compose(["trainer.total_steps=2"])) is None
    assert reference_result(compose(["model.path=/tmp", "model.build=null"])) is None
