"""A random tiny Qwen2 for tests that need a real architecture but no tokenizer or folder
(``tests/conftest.py``'s ``tiny_model_dir`` builds a whole model folder)."""

from __future__ import annotations

import torch

# Two 32-wide layers, 2 query heads sharing 1 KV head (grouped-query attention), 64 tokens.
DEFAULTS = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def tiny_qwen2(seed: int = 0, **config):
    """A float32 ``Qwen2ForCausalLM`` with ``DEFAULTS``, built right after ``torch.manual_seed(seed)``
    (so its weights depend on the seed alone); ``config`` overrides any ``Qwen2Config`` field."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**DEFAULTS, **config}))
