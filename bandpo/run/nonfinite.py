"""Guards against NaN/inf: find the offending tensor, then skip the step (counted) or stop.

One NaN in rewards, log-probs or the loss turns every gradient of an update into NaN, and
an optimizer step with NaN gradients ruins the weights for good. The trainer checks the
batch before the update (``first_nonfinite``) and the actor checks its loss and gradients
(see ``bandpo.actor.worker``); what happens next is the trainer's ``NonfiniteGuard``.
"""

from __future__ import annotations

import torch

from bandpo.errors import check_choice

BATCH_TENSORS = ("rewards", "advantages", "old_logprobs", "ref_logprobs", "old_entropy")
ON_NONFINITE = ("skip", "stop")  # trainer.on_nonfinite (NonfiniteGuard)
INJECT_TARGETS = ("rewards", "logprobs")  # trainer.inject_nonfinite (inject_nonfinite)


def first_nonfinite(batch, names: tuple[str, ...] = BATCH_TENSORS, masked: bool = True) -> str:
    """The name of the first tensor in ``names`` holding a NaN/inf, or "" when all are finite.

    Absent (None) tensors are skipped. With ``masked``, [N, R] tensors are checked only at
    response tokens (``batch.response_mask``); otherwise everywhere, padding included (the
    loss multiplies padding by 0, and NaN * 0 is NaN).
    """
    mask = batch.response_mask.bool()
    for name in names:
        t = getattr(batch, name)
        if t is None:
            continue
        values = t[mask] if masked and t.dim() == 2 else t
        if not bool(torch.isfinite(values).all()):
            return name
    return ""


class NonfiniteGuard:
    """Counts steps skipped for NaN/inf and raises when they must stop the run.

    Args:
        on_nonfinite: ``skip`` (count the step, go on) or ``stop`` (raise at the first one).
        max_skipped: a run that skips more steps than this stops anyway: something is broken.
        skipped: steps skipped so far (restored on resume).
    """

    def __init__(self, on_nonfinite: str = "skip", max_skipped: int = 5, skipped: int = 0):
        check_choice(on_nonfinite, ON_NONFINITE, "on_nonfinite")
        self.on_nonfinite = on_nonfinite
        self.max_skipped = max_skipped
        self.skipped = skipped

    def check(self, step: int, what: str) -> bool:
        """True when step ``step`` must skip its update because of ``what`` ("" = nothing wrong).

        ``what`` names the tensor (``rewards``, ``old_logprobs``, ``loss`` ...). Raises
        FloatingPointError naming it under ``stop`` or past ``max_skipped`` skipped steps.
        """
        if not what:
            return False
        self.skipped += 1
        msg = f"step {step}: non-finite values (NaN/inf) in {what}"
        if self.on_nonfinite == "stop":
            raise FloatingPointError(f"{msg}; stopping (trainer.on_nonfinite=stop)")
        if self.skipped > self.max_skipped:
            raise FloatingPointError(
                f"{msg}; stopping after {self.skipped} skipped steps "
                f"(trainer.max_skipped_steps={self.max_skipped})"
            )
        print(f"[bandpo] {msg}; update skipped ({self.skipped} skipped so far)", flush=True)
        return True


def inject_nonfinite(batch, what: str) -> None:
    """Test hook (``trainer.inject_nonfinite_step``): put a NaN into the batch's ``what``.

    ``rewards`` poisons the first row's reward, ``logprobs`` the old log-prob of the last row's
    last response token (a row of the old-logprob pass: with ``actor.reuse_old_logprobs`` the
    first optimizer step's rows get theirs from the update); the guard must then skip (or stop)
    the step as for a real NaN.
    """
    if what == "rewards":
        batch.rewards[0] = float("nan")  # [N]
    elif what == "logprobs":
        if batch.old_logprobs is None:  # actor.reuse_old_logprobs: they come from the update's forward
            raise ValueError(
                "trainer.inject_nonfinite=logprobs needs the separate old-logprob pass "
                "(set actor.reuse_old_logprobs=false)"
            )
        row, col = batch.response_mask.nonzero()[-1].tolist()
        batch.old_logprobs[row, col] = float("nan")  # [N, R]
    else:
        check_choice(what, INJECT_TARGETS, "inject_nonfinite: what")
