"""The trainer's step with offload during rollout (stand-in workers, no Ray): the engines sleep, the
actor's states come back, log-probs and update run, the states go to host memory, then the engines
wake for the weight sync, after which the weights the sync read go to host memory too, before the
engines' KV cache returns."""

from types import SimpleNamespace

import pytest
import torch

from bandpo.actor.group import UpdateResult
from bandpo.config import compose
from bandpo.parts import Workers
from bandpo.trainer import loop
from bandpo.trainer.dynamic_sampling import Drawn, Round
from bandpo.types import TrainBatch
from tests.helpers.actor import make_rollout
from tests.helpers.parts import fake_parts


class _Actor:
    reuse_old = False

    def __init__(self, log, offloads):
        self.log, self.offloads = log, offloads

    def offload(self):
        self.log.append("actor.offload")

    def offload_weights(self):
        self.log.append("actor.offload_weights")

    def reload(self):
        self.log.append("actor.reload")

    def old_logprobs(self, batch):
        self.log.append("actor.old_logprobs")
        batch.old_logprobs = torch.zeros(batch.response_ids.shape)  # [N, R]
        return torch.zeros(batch.response_ids.shape)  # [N, R]

    def update(self, batch, options, epochs, entropy):
        self.log.append("actor.update")
        return UpdateResult({"loss": 0.0}, 0, 1, None)


class _Rollout:
    sleeps, drops_weights = True, False

    def __init__(self, log):
        self.log = log

    def sleep(self):
        self.log.append("engines.sleep")

    def wake_weights(self, load):
        self.log.append("engines.wake_up(weights)")

    def wake_kv_cache(self):
        self.log.append("engines.wake_up(kv_cache)")


class _Drawer:
    def __init__(self, trainer, log):
        self.trainer, self.log = trainer, log

    def draw(self, step):
        self.log.append("engines.generate")
        self.trainer.timings["rollout"] = 1.0
        rb = make_rollout(4, step)
        batch = TrainBatch.from_rollout(rb, rewards=torch.tensor([1.0, -1.0, 1.0, -1.0]))
        batch.prompt_index = torch.tensor([0, 0, 1, 1])  # [N]: two groups of n = 2
        return Drawn(Round([0, 1], batch, ["a"] * 4, []), {}, [], int(rb.response_mask.sum()))


def _trainer(offloads, *overrides):
    cfg = compose(["rollout.n=2", "algorithm.kl_coef=0", "actor.micro_batch_size=2", *overrides])
    log = []
    workers = Workers(rollout=_Rollout(log), actor=_Actor(log, offloads))
    sampler = SimpleNamespace(load_state_dict=lambda state: None)
    trainer = loop.Trainer(cfg, fake_parts(cfg, workers=workers, sampler=sampler))  # synchronous
    trainer.step = 1
    trainer.drawer = _Drawer(trainer, log)  # stand-ins for the drawer and the sync (no Ray)
    trainer.sync_weights = lambda: log.append("actor->engines weight sync")
    return trainer, log


@pytest.mark.parametrize("offloads", [True, False])
def test_states_leave_the_gpu_before_the_engines_wake_and_return_once_they_sleep(monkeypatch, offloads):
    monkeypatch.setattr(loop, "reward_metrics", lambda scores: {})
    trainer, log = _trainer(offloads)
    metrics = trainer.train_step()
    moves = ["actor.reload", "actor.offload"] if offloads else []
    weights = ["actor.offload_weights"] if offloads else []  # the IPC / NCCL transports read them on the GPU
    assert log == [
        "engines.generate",
        "engines.sleep",
        *moves[:1],
        "actor.old_logprobs",
        "actor.update",
        *moves[1:],
        "engines.wake_up(weights)",
        "actor->engines weight sync",
        *weights,
        "engines.wake_up(kv_cache)",
    ]
    assert ("time/reload" in metrics and "time/offload" in metrics) is offloads


@pytest.mark.parametrize("drops_weights", [False, True])
def test_a_skipped_step_syncs_only_when_the_engines_slept_without_their_weights(monkeypatch, drops_weights):
    # Step 1's rewards are made NaN (the test hook): the guard skips the update, the weights are unchanged.
    # At sleep level 1 the engines wake with their own copy; at level 2 they have none and must load the actor's.
    monkeypatch.setattr(loop, "reward_metrics", lambda scores: {})
    trainer, log = _trainer(True, "trainer.inject_nonfinite_step=1")
    trainer.workers.rollout.drops_weights = drops_weights
    metrics = trainer.train_step()
    assert metrics["trainer/skipped_steps"] == 1 and "actor.update" not in log
    sync = ["actor->engines weight sync"] if drops_weights else []
    assert log[log.index("actor.offload") :] == [
        "actor.offload",
        "engines.wake_up(weights)",
        *sync,
        "actor.offload_weights",
        "engines.wake_up(kv_cache)",
    ]


def test_resume_loads_the_states_while_the_engines_sleep(tmp_path):
    trainer, log = _trainer(offloads=True)
    trainer.workers.actor.call = lambda method, *args: log.append(f"actor.{method}")
    trainer.ckpt = SimpleNamespace(
        remove_stale=lambda: None,
        latest=lambda: tmp_path,
        load_state=lambda folder, required: {"step": 3, "sampler": {}},
    )
    trainer._resume()
    # load_checkpoint brings an offloaded rank's states back, loads, and offloads them again (Actor),
    # all but the weights, which leave once the engines have them.
    assert log == [
        "engines.sleep",
        "actor.load_checkpoint",
        "engines.wake_up(weights)",
        "actor->engines weight sync",
        "actor.offload_weights",
        "engines.wake_up(kv_cache)",
    ]
    assert trainer.step == 3
