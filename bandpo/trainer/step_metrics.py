"""The metrics a training step logs beside the actor's and the reward's: responses, health, timings."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

from bandpo.algo.mismatch import mismatch_stats
from bandpo.types import TrainBatch


def rollout_metrics(batch: TrainBatch, entropy: torch.Tensor | None, first_n: int) -> dict[str, float]:
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
    return {**out, **actor_metrics(batch, batch.old_logprobs, entropy, first_n)}


def actor_metrics(
    batch: TrainBatch, actor_logprobs: torch.Tensor, entropy: torch.Tensor, first_n: int
) -> dict[str, float]:
    """The actor's entropy (also split by ``entropy_split_metrics``, ``first_n`` its
    ``trainer.entropy_first_n``), its health metrics against the engines' sampling log-probs and the
    rollout/actor mismatch's ``mismatch/log_ratio_*``, over the batch's first k rows: ``actor_logprobs``
    and ``entropy`` are [k, R], the actor's for those rows (every row's pi_old; with
    actor.old_logprobs=rollout the update's first forward over its first mini-batch)."""
    k = actor_logprobs.shape[0]
    mask, rollout = batch.response_mask[:k], batch.rollout_logprobs[:k]  # [k, R]
    diff = (rollout - actor_logprobs)[mask.bool()]  # log pi_rollout - log pi_actor, same tokens
    ended = torch.tensor([f == "stop" for f in batch.finish_reasons[:k]], dtype=torch.bool)  # [k]
    return {
        "actor/entropy": entropy[mask.bool()].mean().item(),
        **entropy_split_metrics(entropy, mask, ended, first_n),
        "health/rollout_actor_abs_diff": diff.abs().mean().item(),
        # log(pi_old / pi_rollout): the log of the truncated importance weight before its cap.
        "health/rollout_actor_log_ratio_mean": (-diff).mean().item(),
        "health/rollout_actor_log_ratio_max": (-diff).max().item() if diff.numel() else 0.0,
        # k3 estimate of KL(pi_rollout || pi_actor) from the rollout's own samples.
        "health/rollout_actor_kl": (torch.exp(-diff) - 1 + diff).mean().item(),
        **mismatch_stats(actor_logprobs, rollout, mask),
    }


def entropy_split_metrics(
    entropy: torch.Tensor, mask: torch.Tensor, ended: torch.Tensor, first_n: int
) -> dict[str, float]:
    """Rollout entropy split so that response length cannot stand in for it.

    ``actor/entropy`` is a token mean: a response weighs by its length, so a batch with longer
    (often truncated) responses shows their entropy, and a change of length reads as a change of
    entropy. These metrics take the same per-token entropy ``entropy`` [N, R] over the valid tokens
    ``mask`` [N, R] (1 = response token) of rows that ``ended`` [N] (bool: finish reason ``stop``,
    EOS or a stop string, not the length cap):

    - ``entropy/ended``: token mean over the responses that ended;
    - ``entropy/ended_first_n``: token mean over the first ``first_n`` tokens of those responses
      (every ended response gives at most ``first_n`` tokens: length weighs far less);
    - ``entropy/seq_mean``: mean over responses (with a token) of each one's mean entropy, every
      response weighing the same;
    - ``entropy/len_q{1..4}``: token mean within each response-length quartile of the batch, and
      ``response/len_q{1..4}_max`` the quartile's upper bound in tokens. With lengths sorted
      ``s[0] <= ... <= s[N-1]``, bound q is ``s[ceil(q N / 4) - 1]`` and a response goes to the first
      quartile whose bound is >= its length, so equal lengths share a quartile (which may leave
      another one empty).

    A metric over an empty set (no ended response, an empty quartile) is absent, never NaN.
    """
    valid = mask.bool()  # [N, R]
    ent = torch.where(valid, entropy.float(), torch.zeros((), dtype=torch.float32))  # [N, R], 0 off mask
    lengths = valid.sum(1)  # [N]
    row_sum = ent.sum(1)  # [N]
    out: dict[str, float] = {}

    def token_mean(name: str, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        count = tokens[rows].sum()
        if count > 0:
            out[name] = (ent * tokens)[rows].sum().item() / count.item()

    ended = ended.to(torch.bool)
    token_mean("entropy/ended", ended, valid)
    first = valid & (valid.cumsum(1) <= first_n)  # [N, R]: a row's first first_n valid tokens
    token_mean("entropy/ended_first_n", ended, first)
    nonempty = lengths > 0  # [N]
    if nonempty.any():
        out["entropy/seq_mean"] = (row_sum[nonempty] / lengths[nonempty]).mean().item()
    n = lengths.numel()
    if n == 0:
        return out
    ordered = lengths.sort().values  # [N]
    bounds = [int(ordered[math.ceil(q * n / 4) - 1]) for q in range(1, 5)]
    lower = -1
    for q, bound in enumerate(bounds, start=1):
        out[f"response/len_q{q}_max"] = float(bound)
        token_mean(f"entropy/len_q{q}", (lengths > lower) & (lengths <= bound), valid)
        lower = bound
    return out


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
