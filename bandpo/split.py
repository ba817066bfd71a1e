"""Dividing ``n`` items among ``k`` workers as contiguous, near-equal ranges.

The rollout engines' prompts and the verifier actors' responses are both split this way.
Light (no imports), so the reward package uses it without depending on the rollout package.
"""

from __future__ import annotations


def split_evenly(n_items: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous [start, end) ranges covering ``range(n_items)``, sizes differing by at most one."""
    if k < 1:
        raise ValueError(f"need at least one worker, got {k}")
    base, extra = divmod(n_items, k)
    out, start = [], 0
    for j in range(k):
        end = start + base + (j < extra)
        out.append((start, end))
        start = end
    return out
