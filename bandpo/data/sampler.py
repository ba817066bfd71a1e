"""Deterministic, resumable sampling of example indices over epochs.

Epoch ``e`` visits the indices in the order ``permutation(seed, e)`` (a fresh shuffle per
epoch, a function of the seed and the epoch only), so the whole stream of batches is fixed
by ``seed`` and a checkpointed ``(epoch, cursor)`` resumes it exactly.

Dynamic sampling (DAPO) draws a variable number of batches per step; ``draw_groups`` is its
control loop and ``rollout_seed`` the per-(step, round) sampling seed, so the sampler's state
and the seeds still determine every rollout, and resuming replays them.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class EpochSampler:
    """Hands out batches of indices into a dataset of ``num_examples`` items.

    ``drop_last=False`` (default): a batch may run across an epoch boundary, so every example
    is used once per epoch. ``drop_last=True``: the tail of an epoch too short for a full
    batch is skipped and the batch comes from the next epoch.
    """

    def __init__(self, num_examples: int, seed: int = 0, shuffle: bool = True, drop_last: bool = False):
        if num_examples <= 0:
            raise ValueError(f"EpochSampler needs at least one example, got num_examples={num_examples}")
        self.num_examples = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0  # position inside the current epoch's order
        self._order: np.ndarray | None = None  # cached order of self.epoch

    def order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch`` (identity when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def _current_order(self) -> np.ndarray:
        if self._order is None:
            self._order = self.order(self.epoch)
        return self._order

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.cursor = 0
        self._order = None

    def next_batch(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` indices, moving into the next epoch(s) as needed."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if self.drop_last:
            if batch_size > self.num_examples:
                raise ValueError(
                    f"drop_last: batch_size {batch_size} exceeds the dataset size {self.num_examples}"
                )
            if self.cursor + batch_size > self.num_examples:
                self._advance_epoch()
        out: list[int] = []
        while len(out) < batch_size:
            if self.cursor >= self.num_examples:
                self._advance_epoch()
            take = min(batch_size - len(out), self.num_examples - self.cursor)
            out.extend(int(i) for i in self._current_order()[self.cursor : self.cursor + take])
            self.cursor += take
        return out

    def batches_per_epoch(self, batch_size: int) -> int:
        """Full batches in one epoch (with drop_last) or batches to cover it (without)."""
        full, rest = divmod(self.num_examples, batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    @property
    def consumed(self) -> int:
        """Positions passed so far, counting skipped epoch tails as passed."""
        return self.epoch * self.num_examples + self.cursor

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: plain ints/bools, safe for JSON and torch.save."""
        return {
            "num_examples": self.num_examples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; a different dataset size, seed or mode is an error (not exact)."""
        for key in ("num_examples", "seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state mismatch on {key!r}: checkpoint has {state[key]!r}, this run has "
                    f"{getattr(self, key)!r}; resuming would not reproduce the same batches"
                )
        if not 0 <= state["cursor"] <= self.num_examples or state["epoch"] < 0:
            raise ValueError(f"sampler state out of range: epoch={state['epoch']}, cursor={state['cursor']}")
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._order = None


def rollout_seed(seed: int, step: int, round_: int = 0) -> int:
    """The sampling seed of a step's ``round_``-th rollout: a function of (seed, step, round) only.

    Round 0 keeps the seed the trainer always used (``seed * 1_000_003 + step``), so runs without
    dynamic sampling are unchanged; later rounds are offset by multiples of 2^32, beyond any
    round-0 seed of another step.
    """
    return seed * 1_000_003 + step + round_ * (1 << 32)
