"""One-step off-policy overlap (trainer.max_staleness): the loop's order with stand-in workers (no Ray),
the checkpointed batch drawn ahead, the CPU thread split and the refused layout."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from bandpo.actor.group import UpdateResult
from bandpo.config import compose
from bandpo.config.checks import check_layout
from bandpo.errors import ConfigError
from bandpo.reward import Score
from bandpo.trainer.dynamic_sampling import Drawn, Round
from bandpo.trainer.loop import Trainer
from bandpo.trainer.overlap import Background, cpu_threads, overlap_seconds
from bandpo.types import RolloutBatch, TrainBatch

N, R = 8, 3  # rows (one prompt x rollout.n=8 of the tiny default), response positions


class Engines:
    """The engines' weights version: the actor's update count at the last sync."""

    sleeps = drops_weights = False

    def __init__(self):
        self.version = 0

    def sleep(self):  # a no-op without sleep mode, as RolloutGroup's
        pass

    def wake_weights(self, load):
        pass

    def wake_kv_cache(self):
        pass


class Draws:
    """``BatchDrawer.draw`` stand-in: records (step, engines' version, thread) and times a 'rollout' stage."""

    def __init__(self, trainer, engines):
        self.trainer, self.engines, self.log = trainer, engines, []

    def draw(self, step):
        self.log.append((step, self.engines.version, threading.current_thread() is threading.main_thread()))
        with self.trainer.timed("rollout"):
            time.sleep(0.05)
        batch = TrainBatch.from_rollout(
            RolloutBatch(
                prompt_ids=torch.ones(N, 2, dtype=torch.long),
                prompt_mask=torch.ones(N, 2, dtype=torch.long),
                response_ids=torch.full((N, R), step, dtype=torch.long),
                response_mask=torch.ones(N, R, dtype=torch.long),
                rollout_logprobs=torch.full((N, R), -float(step)),
                prompt_index=torch.zeros(N, dtype=torch.long),
                finish_reasons=["stop"] * N,
            )
        )
        batch.rewards = torch.tensor([1.0, -1.0] * (N // 2))  # [N]
        scores = [
            Score(float(r), "correct" if r > 0 else "incorrect", None, r > 0) for r in batch.rewards.tolist()
        ]
        return Drawn(Round([step], batch, [""] * N, scores), {}, scores, N * R)


class Actor:
    """Records which step's batch each update trained on, and the actor's version then."""

    reuse_old = False
    offloads = False  # offload is a colocated-GPU feature; overlap refuses that layout

    def __init__(self):
        self.version, self.trained = 0, []

    def old_logprobs(self, batch):
        batch.old_logprobs = batch.rollout_logprobs.clone()  # [N, R]
        return torch.zeros(N, R)

    def compute_logprobs(self, batch, ref=False):
        return batch.rollout_logprobs.clone(), None  # [N, R]

    def update(self, batch, options, epochs, entropy):
        time.sleep(0.05)
        self.trained.append((int(batch.response_ids[0, 0]), self.version))
        self.version += 1
        return UpdateResult({"loss": 0.0}, 0, 1, None)

    def call(self, method, folder):
        folder = Path(folder)
        if method == "save_checkpoint":
            folder.mkdir(parents=True)
            (folder / "version").write_text(str(self.version))
        elif method == "load_checkpoint":
            self.version = int((folder / "version").read_text())


def make_trainer(tmp_path, staleness, steps=3):
    from bandpo.data import EpochSampler
    from bandpo.parts import Workers
    from tests.helpers.parts import fake_parts

    cfg = compose(
        [
            f"trainer.max_staleness={staleness}",
            f"trainer.total_steps={steps}",
            "trainer.save_every=2",
            "trainer.eval_before_train=false",
            "trainer.export_hf=false",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    engines, actor = Engines(), Actor()
    workers = Workers(rollout=engines, actor=actor)
    t = Trainer(cfg, fake_parts(cfg, tmp_path, workers=workers, sampler=EpochSampler(100, seed=0)))
    t.drawer = Draws(t, engines)  # stand-ins for the drawer and the sync (no Ray)

    def sync():
        engines.version = actor.version

    t.sync_weights = sync
    return t


def run(t, steps):
    rows = []
    for _ in range(steps):
        t.step += 1
        rows.append(t.train_step())
        if t.step % t.cfg.trainer.save_every == 0:
            t.save()
    return rows


def test_synchronous_loop_draws_each_batch_on_the_latest_weights(tmp_path):
    t = make_trainer(tmp_path, 0)
    rows = run(t, 3)
    assert t.drawer.log == [(1, 0, True), (2, 1, True), (3, 2, True)]
    assert t.workers.actor.trained == [(1, 0), (2, 1), (3, 2)]
    assert [r["health/staleness"] for r in rows] == [0, 0, 0]
    assert not any("time/overlap" in r for r in rows)


def test_one_step_off_policy_draws_the_next_batch_in_the_background_on_the_previous_weights(tmp_path):
    t = make_trainer(tmp_path, 1)
    rows = run(t, 3)
    # Step 1 draws its own batch (foreground) and batch 2 in the background, both on the initial
    # weights; step 2 draws batch 3 on the weights after step 1; step 3 (the last) draws nothing.
    assert t.drawer.log == [(1, 0, True), (2, 0, False), (3, 1, False)]
    assert t.workers.actor.trained == [(1, 0), (2, 1), (3, 2)]
    assert [r["health/staleness"] for r in rows] == [0, 1, 1]
    assert t.loss.tis_cap == 2.0  # decoupled PPO's behaviour weight is on by default
    for r in rows[:2]:  # both sides slept 0.05 s at once
        assert 0 < r["time/overlap"] <= r["time/background"]
    assert "time/overlap" not in rows[2] and "perf/rollout_tokens_per_s" not in rows[2]


def test_the_batch_drawn_ahead_is_checkpointed_and_resumed(tmp_path):
    t = make_trainer(tmp_path, 1, steps=4)
    run(t, 2)  # checkpoint at step 2 holds batch 3, drawn on the weights after step 1
    pending = t.in_flight
    assert (pending.step, pending.version) == (3, 1)
    assert (tmp_path / "checkpoints" / "step_000002" / "in_flight.pt").exists()

    resumed = make_trainer(tmp_path, 1, steps=4)
    resumed._resume()
    assert (resumed.step, resumed.engine_version, resumed.workers.actor.version) == (2, 2, 2)
    assert (resumed.in_flight.step, resumed.in_flight.version) == (3, 1)
    assert torch.equal(
        resumed.in_flight.drawn.round.batch.response_ids, pending.drawn.round.batch.response_ids
    )
    rows = run(resumed, 2)
    assert resumed.drawer.log == [(4, 2, False)]  # batch 3 is not regenerated
    assert resumed.workers.actor.trained == [(3, 2), (4, 3)]
    assert [r["health/staleness"] for r in rows] == [1, 1]


class MakeDir:
    """Unpickling it calls ``os.mkdir(path)``: what a crafted checkpoint file would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)


@pytest.mark.parametrize("file", ["in_flight.pt", "actor/state/mp_rank_00_model_states.pt"])
def test_resume_refuses_a_checkpoint_file_holding_code_before_any_worker_reads_it(tmp_path, file):
    """The driver checks the step folder (only the pickles, nothing unpickled) before the actor loads it;
    the batch drawn ahead is loaded with weights_only=True and its own dataclasses allowed."""
    from bandpo.errors import UnsafeCheckpoint

    t = make_trainer(tmp_path, 1, steps=4)
    run(t, 2)
    crafted = tmp_path / "checkpoints" / "step_000002" / file
    crafted.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.ones(2)}, "extra": MakeDir(tmp_path / "pwned")}, crafted)
    resumed = make_trainer(tmp_path, 1, steps=4)
    with pytest.raises(
        UnsafeCheckpoint, match=rf"^unsafe checkpoint: {crafted} holds pickled code \(posix.mkdir\)"
    ):
        resumed._resume()
    assert not (tmp_path / "pwned").exists()
    if file != "in_flight.pt":
        assert resumed.workers.actor.version == 0  # refused before the actor's load_checkpoint


def test_background_returns_and_reraises():
    bg = Background(lambda: 7, "t")
    assert bg.join() == 7 and bg.interval[0] <= bg.interval[1]

    def boom():
        raise ValueError("engine")

    with pytest.raises(ValueError, match="engine"):
        Background(boom, "t").join()
    assert overlap_seconds((0.0, 2.0), (1.0, 3.0)) == 1.0 and overlap_seconds((0.0, 1.0), (2.0, 3.0)) == 0.0


def test_cpu_threads_are_divided_only_when_overlapped():
    # (cores, engines, ranks, staleness, rollout.cpu_threads, actor.cpu_threads) -> (per engine, per rank)
    assert cpu_threads(2, 1, 1, 0, None, None) == (2, None)  # synchronous: each side has every core in turn
    assert cpu_threads(2, 1, 1, 1, None, None) == (1, 1)
    assert cpu_threads(16, 2, 2, 1, None, None) == (4, 4)
    assert cpu_threads(2, 1, 1, 1, 1, 2) == (1, 2)  # configured counts win
    assert cpu_threads(2, 1, 1, 0, 1, 1) == (1, 1)  # the split analogue, synchronous


def test_colocated_gpu_layout_is_refused_naming_the_keys():
    check_layout(1, "split")
    check_layout(1, "cpu")
    check_layout(0, "colocated")
    with pytest.raises(ConfigError, match=r"trainer.max_staleness=1 .*actor.gpus and rollout.gpus"):
        check_layout(1, "colocated")
    with pytest.raises(ConfigError, match="trainer.max_staleness"):
        compose(["trainer.max_staleness=1", "trainer.device=cuda"])
    compose(["trainer.max_staleness=1", "trainer.device=cuda", "actor.gpus=1", "rollout.gpus=1"])
    with pytest.raises(ConfigError, match="trainer.max_staleness must be one of 0, 1"):
        compose(["trainer.max_staleness=2"])
    with pytest.raises(ConfigError, match="algorithm.tis_cap must be >= 1"):
        compose(["trainer.max_staleness=1", "algorithm.tis_cap=0.5"])
