"""What the actor benchmarks share (``benchmarks.actor``, ``benchmarks.actor_compare``, ``benchmarks.load``,
``profile_actor.py``): a random Qwen2 written to disk, ``--bf16`` as the actor resolves it, the
machine's matmul peak and a pass's model FLOP/s as a fraction of it, and a call's seconds and peak
RSS. It imports no other script, so the scripts' imports go one way (``benchmarks.actor`` imports
``benchmarks.actor_compare`` for ``--single``, both import this module)."""

from __future__ import annotations

import os
import time


def build_model(
    path: str, hidden: int, layers: int, intermediate: int, vocab: int, kv_heads: int, max_len: int = 4096
) -> int:
    """Write a random Qwen2 (no tokenizer: the actor does not need one) and return its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=min(kv_heads, max(hidden // 64, 1)),
        tie_word_embeddings=True,
        max_position_embeddings=max(max_len, 4096),
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def matmul_peak(
    hidden: int, intermediate: int, dtype, device="cpu", min_seconds: float = 0.2, max_tokens: int = 4096
) -> dict:
    """Best torch.mm FLOP/s on this process's threads in ``dtype`` over the projection shapes of a model of
    ``hidden`` / ``intermediate`` sizes: T tokens doubled from 16 until one product takes ``min_seconds``
    (or T reaches ``max_tokens``), then the fastest of 3 timings. Emulated bf16 (a CPU without
    AVX512-BF16 / AMX) stops at small T; native types run up to ``max_tokens``."""
    import torch

    dev = torch.device(device)

    def timed(a, b) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    rates = {}
    for k, n in ((hidden, hidden), (hidden, intermediate), (intermediate, hidden)):  # q/o, gate/up, down
        b = torch.randn(k, n, device=dev).to(dtype)
        t = 16
        while True:
            a = torch.randn(t, k, device=dev).to(dtype)
            timed(a, b)  # warm-up: the kernel's first call
            if timed(a, b) >= min_seconds or t >= max_tokens:
                break
            t *= 2
        rates[f"{t}x{k}x{n}"] = 2.0 * t * k * n / min(timed(a, b) for _ in range(3))
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "flops_per_s": max(rates.values()),
        "by_shape": rates,
    }


def peak_fractions(
    params: int, update_tokens: int, update_s: float, logprob_tokens: int, logprob_s: float, peak: float
) -> dict:
    """Model FLOP/s of an update (6 P T) and a log-prob pass (2 P T), and their fractions of ``peak``."""
    update, logprob = 6.0 * params * update_tokens / update_s, 2.0 * params * logprob_tokens / logprob_s
    return {
        "update_flops_per_s": update,
        "update_peak_frac": update / peak,
        "logprob_flops_per_s": logprob,
        "logprob_peak_frac": logprob / peak,
    }


def resolved_bf16(setting: str) -> bool:
    """``--bf16`` (auto / true / false) as ``actor.bf16`` resolves it on this machine."""
    import torch

    from bandpo.distributed.precision import resolve_bf16

    value = {"auto": "auto", "true": True, "false": False}[setting]
    return resolve_bf16(value, "cuda" if torch.cuda.is_available() else "cpu")


def rss_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``: resident pages x page size)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_peak(fn):
    """(seconds, peak RSS bytes) of ``fn()``, RSS sampled every 5 ms by a thread."""
    import threading

    peak, done = [rss_bytes()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    return seconds, max(peak[0], rss_bytes())
