"""The metrics a training step logs beside the actor's and the reward's: responses, health, timings."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from bandpo.algo.mismatch import mismatch_stats
from bandpo.types import TrainBatch


def rollout_metrics(batch: TrainBatch, entropy: torch.Tensor | None) -> dict[str, float]:
    """Response lengths; with the actor's old logprobs and entropy [N, R] also ``actor_metrics`` over
    every row (absent until the update's forward made them, with reuse_old_logprobs)."""
    lengths = batch.response_lengths.float()  # [N]
    out = {
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(f == "length" for f in batch.finish_reasons) / max(batch.size, 1),
    }
    if entropy is None or batch.old_logprobs is None:
        return out
    return {**out, **actor_metrics(batch, batch.old_logprobs, entropy)}


def actor_metrics(batch: TrainBatch, actor_logprobs: torch.Tensor, entropy: torch.Tensor) -> dict[str, float]:
    """The actor's entropy, its health metrics against the engines' sampling log-probs and the
    rollout/actor mismatch's ``mismatch/log_ratio_*``, over the batch's first k rows: ``actor_logprobs``
    and ``entropy`` are [k, R], the actor's for those rows (every row's pi_old; with
    actor.old_logprobs=rollout the update's first forward over its first mini-batch)."""
    k = actor_logprobs.shape[0]
    mask, rollout = batch.response_mask[:k], batch.rollout_logprobs[:k]  # [k, R]
    diff = (rollout - actor_logprobs)[mask.bool()]  # log pi_rollout - log pi_actor, same tokens
    return {
        "actor/entropy": entropy[mask.bool()].mean().item(),
        "health/rollout_actor_abs_diff": diff.abs().mean().item(),
        # log(pi_old / pi_rollout): the log of the truncated importance weight before its cap.
        "health/rollout_actor_log_ratio_mean": (-diff).mean().item(),
        "health/rollout_actor_log_ratio_max": (-diff).max().item() if diff.numel() else 0.0,
        # k3 estimate of KL(pi_rollout || pi_actor) from the rollout's own samples.
        "health/rollout_actor_kl": (torch.exp(-diff) - 1 + diff).mean().item(),
        **mismatch_stats(actor_logprobs, rollout, mask),
    }


def timing_metrics(
    timings: dict[str, float], step_time: float, gen_tokens: int, last_checkpoint: float | None
) -> dict[str, float]:
    """``time/<stage>`` of this step, ``time/step``, the previous step's checkpoint time (written after its
    metrics line) and throughput over the tokens generated during the step (none at the last step of
    an overlapped run, whose batch was generated during the step before: no rollout rate then)."""
    out = {f"time/{k}": v for k, v in timings.items()}
    out["time/step"] = step_time
    if last_checkpoint is not None:
        out["time/last_checkpoint"] = last_checkpoint
    out["perf/tokens_per_s"] = gen_tokens / step_time
    if "rollout" in timings:
        out["perf/rollout_tokens_per_s"] = gen_tokens / max(timings["rollout"], 1e-9)
    return out


@contextmanager
def timed_into(table: dict[str, float], name: str):
    """Add the seconds the block takes to ``table[name]`` (a stage may run several times a step)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        table[name] = table.get(name, 0.0) + time.perf_counter() - t0
