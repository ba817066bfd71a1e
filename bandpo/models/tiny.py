"""A tiny Qwen2- (or Llama-) architecture model and byte-level BPE tokenizer, built on the fly.

No weights can be downloaded on CPU test machines, so tests and the tiny recipe build
their own model folder in the Hugging Face format (config.json, model.safetensors,
tokenizer.json, chat template). vLLM's CPU attention rejects head_dim 16, so heads are
64 wide. The folder loads with plain ``transformers`` and ``vllm`` like any hub model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEFAULT_CORPUS = [
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
    'Remember to put your answer on its own line after "Answer:".',
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "What is 12 + 35? 12 + 35 = 47. Answer: 47",
    "Compute 7 * 8 - 3. 7 * 8 = 56, 56 - 3 = 53. The answer is \\boxed{53}.",
    "0123456789 + - * / = ( ) , . ? ! $ \\frac{1}{2} \\sqrt{2} \\pi x y z",
    "user assistant system the a of and is to in what how many",
]


def build_tokenizer(path: str | Path, corpus: Iterable[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on ``corpus`` and save it (HF fast tokenizer) to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus or DEFAULT_CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    return fast


def build_tiny_model(
    path: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    architecture: str = "qwen2",
) -> Path:
    """Write a randomly initialised Qwen2 (``architecture="llama"``: Llama) model + tokenizer to ``path``
    (reused if already built).

    hidden_size / num_heads must be >= 64 (vLLM CPU attention). Returns the folder path.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if architecture not in classes:
        raise ValueError(f"architecture {architecture!r} is not one of {sorted(classes)}")
    config_cls, model_cls = classes[architecture]

    path = Path(path)
    spec = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_pos=max_position_embeddings,
        tied=tie_word_embeddings,
        vocab=vocab_size,
        seed=seed,
        **({"arch": architecture} if architecture != "qwen2" else {}),
    )
    marker = path / "bandpo_tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    if hidden_size // num_heads < 64:
        raise ValueError(
            f"head_dim = hidden_size/num_heads = {hidden_size // num_heads}; vLLM CPU needs >= 64"
        )
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path, corpus, vocab_size)
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return path
