"""DAPO dynamic sampling: the control loop, the per-round seeds, exact resume, group assembly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bandpo.data.sampler import EpochSampler, rollout_seed
from bandpo.trainer.dynamic_sampling import Round, draw_groups
from bandpo.types import TrainBatch


def test_seeds_are_a_function_of_seed_step_round_and_round0_is_unchanged():
    assert rollout_seed(3, 17) == 3 * 1_000_003 + 17  # the seed every run used before rounds existed
    seeds = {rollout_seed(s, step, r) for s in range(3) for step in range(1, 200) for r in range(5)}
    assert len(seeds) == 3 * 199 * 5  # no two (seed, step, round) share a seed


def test_draw_groups_hand_computed():
    flags = [[True, False, True, False], [False, False, True, True], [True, True, True, True]]
    draw = draw_groups(4, 10, lambda r: flags[r])
    assert (draw.rounds, draw.drawn, draw.informative) == (2, 8, 4)
    assert draw.kept == [(0, 0), (0, 2), (1, 2), (1, 3)]
    assert draw.flat == [(0, 1), (0, 3), (1, 0), (1, 1)]
    # Surplus informative groups are dropped (need 3 of 4 found in round 0..1).
    assert draw_groups(3, 10, lambda r: flags[r]).kept == [(0, 0), (0, 2), (1, 2)]
    # max_gen_rounds reached: what there is.
    short = draw_groups(4, 1, lambda r: flags[r])
    assert (short.rounds, short.kept, short.informative) == (1, [(0, 0), (0, 2)], 2)
    with pytest.raises(ValueError):
        draw_groups(0, 1, lambda r: [])


def _fake_steps(sampler: EpochSampler, seed: int, steps: range, need: int = 4, max_rounds: int = 6):
    """Run dynamic sampling with a stand-in 'rollout + reward': a group varies when a hash of
    (prompt index, rollout seed) says so. Returns per step the (prompt index, seed) of each round."""
    log = []
    for step in steps:
        rounds = []

        def run_round(r, step=step, rounds=rounds):
            idx = sampler.next_batch(need)
            s = rollout_seed(seed, step, r)
            rounds.append((idx, s))
            return [np.random.default_rng([i, s]).random() < 0.35 for i in idx]

        draw = draw_groups(need, max_rounds, run_round)
        log.append((rounds, draw.kept))
    return log


def test_sampler_state_and_seeds_resume_identically_after_filtered_steps():
    full = _fake_steps(EpochSampler(23, seed=5), seed=1, steps=range(1, 9))
    assert max(len(r) for r, _ in full) > 1  # some steps needed extra rounds (else this tests nothing)
    first = EpochSampler(23, seed=5)
    _fake_steps(first, seed=1, steps=range(1, 5))
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores (trainer_state.json)
    resumed = EpochSampler(23, seed=5)
    resumed.load_state_dict(state)
    assert _fake_steps(resumed, seed=1, steps=range(5, 9)) == full[4:]


def _round(prompt_ids: list[int], n: int, rewards: list[float]) -> Round:
    rows = len(prompt_ids) * n
    batch = TrainBatch.from_lists(
        [[1, 2]] * rows,
        [[10 + r] * (1 + r % 3) for r in range(rows)],
        [[-0.5] * (1 + r % 3) for r in range(rows)],
        [g for g in range(len(prompt_ids)) for _ in range(n)],
        ["stop"] * rows,
        pad_id=0,
    )
    batch.rewards = torch.tensor(rewards)
    scores = [SimpleNamespace(reward=x) for x in rewards]
    return Round(list(prompt_ids), batch, [f"t{r}" for r in range(rows)], scores)


def test_round_gather_keeps_groups_in_order_and_renumbers_prompts():
    n = 2
    a = _round([7, 8], n, [1.0, -1.0, -1.0, -1.0])
    b = _round([9, 3], n, [1.0, 1.0, 1.0, -1.0])
    out = Round.gather([a, b], [(0, 0), (1, 1), (0, 1)], n)
    assert out.idx == [7, 3, 8]
    assert out.batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.batch.rewards.tolist() == [1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
    assert out.texts == ["t0", "t1", "t2", "t3", "t2", "t3"]
    assert [s.reward for s in out.scores] == out.batch.rewards.tolist()
    # Response rows travel with their group (re-padded to the widest kept row).
    assert out.batch.response_ids[2].tolist()[:3] == [12, 12, 12] and out.batch.response_mask[2].sum() == 3
