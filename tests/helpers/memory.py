"""The small config the memory-estimate tests compute by hand, and its estimate (full and LoRA tests)."""

from __future__ import annotations

from bandpo.config import compose
from bandpo.distributed.memory import memory_estimate
from bandpo.distributed.plan import ClusterShape, make_plan

# P = 2**30 parameters on W = 2 ranks, H = 1024, I = 2816, 8 heads, 2 KV heads, L = 4, V = 32768,
# 8192 packed tokens, chunk 256, ZeRO-2, checkpointing (the qwen2.5-3b file's), no KL term.
SMALL = [
    "model=qwen2.5-3b",
    "model.num_params=1073741824",
    "model.hidden_size=1024",
    "model.num_layers=4",
    "model.vocab_size=32768",
    "model.intermediate_size=2816",
    "model.num_heads=8",
    "model.num_kv_heads=2",
    "actor.num_workers=2",
    "rollout.num_workers=2",
    "algorithm.kl_coef=0",
    "actor.max_tokens_per_micro_batch=8192",
    "actor.logits_chunk_tokens=256",
    "actor.zero_stage=2",
]


def estimate(overrides, capacity):
    """``memory_estimate`` of ``overrides`` on one node of ``actor.num_workers`` GPUs of ``capacity`` GiB."""
    cfg = compose(overrides)
    plan = make_plan(cfg, ClusterShape(1, int(cfg.actor.num_workers)), "cuda")
    return memory_estimate(cfg, plan, capacity)
