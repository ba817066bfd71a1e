"""The RLVR training loop (GRPO / Clip-Higher / BandPO), one named, timed stage at a time.

Per step (BandPO's recipe: GRPO's loop with the Band-clipped loss):
    1. sample      B prompts from the shuffled training set (resumable sampler)
    2. rollout     n responses per prompt from vLLM with their sampling logprobs
    3. reward      rule-based verifier: Ray actors, each with a process pool (+1 correct / -1 otherwise)
       (dynamic_sampling, DAPO, when algorithm.filter_groups.enable: rounds of 1-3 until B groups
       have varying accuracy/reward or max_gen_rounds is reached; equal-metric groups are dropped;
       ``bandpo.trainer.dynamic_sampling``)
       sleep       colocated GPU layout only: the vLLM engines sleep until stage 7 (rollout.sleep_level; at
                   level 2 they drop their weights, and stage 7 loads them even after a skipped update)
       reload      with actor.offload_during_rollout: the actor's states back from host memory
                   (``offload`` sends them there again before stage 7, the weights the sync reads
                   once it has read them; ``bandpo.actor.offload``)
    4. advantages  group-normalised per prompt: (R - mean) / (std + 1e-6)
       trace       every trainer.trace_every steps: the groups with texts, grades and advantages
    5. logprobs    old logprobs (and entropy) from the actor, ref logprobs when kl_coef > 0
                   (``ActorGroup.old_logprobs``; with actor.old_logprobs=rollout the engines', no pass)
    6. update      mini-batched Band-clipped (or fixed-clipped) policy loss, DeepSpeed (``ActorGroup.update``)
       probe       every probe.every steps (before the first, at the last): the policy's entropy on fixed
                   base-model texts, the actor's log-prob pass over them (``bandpo.trainer.probe``)
    7. sync        wake the engines' weights, load the actor's into them, wake their KV cache
                   (``Trainer.wake_engines``, ``bandpo.weight_sync``); the first sync of a run, and
                   every one with rollout.verify_sync, is checked tensor by tensor against the
                   actor's weights (``bandpo.weight_sync.checksums``; ``time/verify_sync``); LoRA on
                   vLLM: the adapter alone (rollout.lora_sync), checked by the next batch's log-probs
                   (``bandpo.trainer.sync_check``, after stage 6 of every synchronous LoRA step)
    8. log / eval / checkpoint

With ``trainer.max_staleness=1`` (one-step off-policy) stages 1-3 of step t+1 run in the
background while 4-6 run on batch t (``draw_ahead`` / ``join_ahead``), under decoupled PPO's
objective with a truncated importance weight (``bandpo.trainer.overlap``, which states it).

Start-up (model, data, Ray, placement, workers) is ``bandpo.trainer.launch.start``, whose record of the
run's parts (``bandpo.parts.RunParts``) the trainer takes; the step's own
metrics (responses, health, timings) are ``bandpo.trainer.step_metrics``.

Departures from the paper's scripts, stated:
- Old logprobs are recomputed by the actor (verl's default) rather than taken from vLLM; the
  gap between the two is logged as ``health/rollout_actor_*`` instead.
- Stage 5's old-logprob pass covers only the rows of the later mini-batches (none with one
  optimizer step per rollout): the first optimizer step's own forward is the policy before
  it, so old = its detached log-probs for the batch's first ``mini_batch_prompts x n`` rows
  (ratio 1 there), and their logged entropy is that forward's (``actor.reuse_old_logprobs``:
  auto | true | false; auto is on except for the adaptive band's ``batch`` scale, which needs
  every row's pi_old entropy first). The ref pass (kl_coef > 0) still covers every row.
- Off by default, ``actor.old_logprobs=rollout`` (verl's bypass mode): pi_old = the engines' log-probs,
  no old-logprob pass (``time/logprobs``: the ref pass's); only the engine/actor numerical gap differs
  (refused where more would: ``bandpo.config.rules``, other dtypes at start-up). The actor's side of the
  health metrics (and stale-weights check) is then the update's first forward, its first mini-batch's rows.
- Sampling is seeded per step and round (``bandpo.data.sampler.rollout_seed``) so a resumed run
  replays the exact rollouts of an uninterrupted one, dynamic sampling's extra rounds included.
- Optional, off by default: truncated importance sampling (``algorithm.tis_cap``) reweights the
  loss by min(pi_old / pi_rollout, C); entropy-adaptive Band (``algorithm.band.adaptive``) uses
  pi_old's per-token entropy from step 5; traces (``trainer.trace_every``) go to <run>/traces/; the
  adaptive entropy bonus (``algorithm.entropy_target``) sets each step's coefficient from the entropy
  the previous update measured (``bandpo.algo.entropy_bonus``; its state is saved with the checkpoints).
- Non-finite rewards, logprobs or loss skip the update (counted) unless ``on_nonfinite=stop``;
  the actor never applies an optimizer step with NaN/inf gradients (``bandpo.run.nonfinite``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from bandpo.actor.group import UpdateResult
from bandpo.algo import compute_advantages
from bandpo.algo.entropy_bonus import entropy_controller
from bandpo.algo.options import LossOptions
from bandpo.checkpoint.run_folders import IN_FLIGHT_FILE, CheckpointManager, load_in_flight, save_in_flight
from bandpo.distributed import stage
from bandpo.errors import WorkerFailure
from bandpo.reward import reward_metrics
from bandpo.run.nonfinite import NonfiniteGuard, first_nonfinite, inject_nonfinite
from bandpo.trainer.dynamic_sampling import BatchDrawer, Drawn, check_groups
from bandpo.trainer.overlap import Background, InFlight, in_flight_types, overlap_seconds
from bandpo.trainer.probe import Probe
from bandpo.trainer.step_metrics import actor_metrics, rollout_metrics, timed_into, timing_metrics
from bandpo.trainer.sync_check import check_sync
from bandpo.types import TrainBatch

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig
    from bandpo.parts import RunParts


class Trainer:
    """The training loop over the parts start-up built (``parts``: ``bandpo.trainer.launch.start``)."""

    def __init__(self, cfg: TrainConfig, parts: RunParts):
        self.cfg, self.parts = cfg, parts
        self.out = parts.out
        self.workers = parts.workers
        self.loss = parts.loss  # the policy loss's options (per step: ``step_loss_options``)
        self.ckpt = CheckpointManager(self.out / "checkpoints", cfg.trainer.keep_last)
        self.timings: dict[str, float] = {}  # stage -> seconds of the current step
        self.step = 0
        self.guard = NonfiniteGuard(cfg.trainer.on_nonfinite, cfg.trainer.max_skipped_steps)
        self.drawer = BatchDrawer(
            cfg,
            parts.sampler,
            parts.prompts.prompt_ids,
            [e.answer for e in parts.prompts.examples],
            parts.workers.rollout,
            parts.workers.scorer,
            parts.tokenizer,
            self.timed,
        )
        # the adaptive entropy bonus' coefficient and last measured entropy; None when it is off
        self.entropy_ctl = entropy_controller(self.loss)
        # rollout.weight_sync's transport (bandpo.weight_sync.transport), made at the first sync
        self.weight_sync = None
        # a sync has been verified (the first of a run always is: bandpo.weight_sync.checksums)
        self.synced = False
        self.sync_over = False  # the last step's stale-weights check was over its tolerance
        self.synced_bytes: int | None = None  # what the step's sync moved (weight_sync/bytes)
        # the engines hold the weights after this step's update (0: the initial model)
        self.engine_version = 0
        self.in_flight: InFlight | None = None  # max_staleness=1: the next step's batch, drawn ahead
        # the fixed-text entropy probe (probe.every); None when it is off
        self.probe = (
            Probe(cfg, self.out, parts.plan.model_path, parts.probe_sets, parts.tokenizer)
            if cfg.probe.every
            else None
        )

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        cfg = self.cfg
        self._resume()
        first = self.start_probe()  # the base policy's probe at step 0
        if self.step == 0 and cfg.trainer.eval_before_train and self.parts.eval_sets:
            first.update(self.evaluate())
        if first:
            self.parts.logger.log(0, first)
        last: dict = {}
        while self.step < cfg.trainer.total_steps:
            self.step += 1
            last = self.train_step()
            if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0 and self.parts.eval_sets:
                last.update(self.evaluate())
            self.parts.logger.log(self.step, last)
            if cfg.trainer.save_every and (
                self.step % cfg.trainer.save_every == 0 or self.step == cfg.trainer.total_steps
            ):
                self.save()
        if cfg.trainer.export_hf:
            with stage("export", "actor"):
                self.workers.actor.call("export_hf", str(self.out / "hf"))
        if self.parts.eval_sets and not (cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0):
            final = self.evaluate()
            self.parts.logger.log(self.step, {"final": True, **final})
            last.update(final)
        return last

    def train_step(self) -> dict:
        """One step, stage by stage (the module docstring); each stage's seconds go to ``time/<stage>``."""
        last_checkpoint = self.timings.get("checkpoint")  # written after its step's line: logged on the next
        self.timings, t_step = {}, time.perf_counter()
        # 1-3: sample, rollout, reward (dynamic sampling: rounds)
        drawn, made_by, generated = self.next_batch()
        background = self.draw_ahead()  # max_staleness=1: 1-3 of the next step while 4-6 run
        self.enter_actor_phase()  # the engines sleep, the actor's states come back
        batch, metrics = self.advantages(drawn)  # 4
        t_actor = time.perf_counter()
        entropy = self.old_logprobs(batch)  # 5
        first_n = self.cfg.trainer.entropy_first_n
        metrics.update(rollout_metrics(batch, None if self.workers.actor.reuse_old else entropy, first_n))
        result = self.update(batch, entropy)  # 6 (None: skipped for a non-finite batch)
        metrics.update(self.update_metrics(batch, result))
        if self.entropy_ctl is not None and result is not None:  # the next step's bonus coefficient
            metrics.update(self.entropy_ctl.observe(result.metrics))
        # the engines sampled from the actor's weights (two steps over the tolerance stop the run)
        self.sync_over = check_sync(metrics, self.parts.sync_tol, self.step, self.sync_over)
        # updates between the batch's weights and pi_old's
        metrics["health/staleness"] = self.step - 1 - made_by
        if background is not None:  # the next step's batch, generated on the weights before this update
            metrics.update(self.join_ahead(background, (t_actor, time.perf_counter())))
            generated += self.in_flight.drawn.gen_tokens
        if self.probe is not None and self.probe.due(self.step):  # the policy after this step's update
            metrics.update(self.measure_probe())
        self.enter_rollout_phase(updated=result is not None)  # 7: the engines wake with the new weights
        metrics["trainer/skipped_steps"] = self.guard.skipped
        if self.synced_bytes is not None:  # this step's sync, per engine node
            metrics["weight_sync/bytes"], self.synced_bytes = self.synced_bytes, None
        return {
            **metrics,
            **timing_metrics(self.timings, time.perf_counter() - t_step, generated, last_checkpoint),
        }

    def next_batch(self) -> tuple[Drawn, int, int]:
        """Stages 1-3: this step's batch, the weights version that generated it, and the tokens
        generated during this step: the batch the previous step drew ahead (max_staleness=1; its
        tokens counted there), else drawn now."""
        ahead, self.in_flight = self.in_flight, None
        if ahead is not None:
            if ahead.step != self.step:
                raise RuntimeError(f"the batch drawn ahead is step {ahead.step}'s, not step {self.step}'s")
            return ahead.drawn, ahead.version, 0
        drawn = self.drawer.draw(self.step)
        return drawn, self.engine_version, drawn.gen_tokens

    def enter_actor_phase(self) -> None:
        """Between stages 3 and 4, the devices go to the actor: colocated engines sleep (their
        weights and KV cache freed), and with offload the actor's states come back from host memory."""
        actor, rollout = self.workers.actor, self.workers.rollout
        if rollout.sleeps:
            with self.timed("sleep"), stage("sleep", "rollout"):
                rollout.sleep()
        if actor.offloads:
            with self.timed("reload"), stage("reload", "actor"):
                actor.reload()

    def enter_rollout_phase(self, updated: bool) -> None:
        """Stage 7, the devices go back to the engines: with offload the actor's states leave first;
        the engines wake with the actor's weights, synced when the step updated them (and at sleep
        level 2, which kept none, even when it did not); then their KV cache."""
        actor, rollout = self.workers.actor, self.workers.rollout
        if actor.offloads:
            with self.timed("offload"), stage("offload", "actor"):
                actor.offload()
        if updated or rollout.sleeps:
            with self.timed("weight_sync"), stage("weight_sync", "actor/rollout"):
                self.wake_engines(load=updated or rollout.drops_weights)
        self.engine_version = self.step  # a skipped update leaves the weights of the step before: the same

    def advantages(self, drawn: Drawn) -> tuple[TrainBatch, dict[str, float]]:
        """Stage 4: group-normalised advantages into the batch (and every ``trace_every`` steps the
        groups' trace); returns the batch and the reward's, advantages' and draw's metrics."""
        batch = drawn.round.batch
        with self.timed("advantages"):
            check_groups(batch.prompt_index, len(drawn.round.idx), self.cfg.rollout.n)
            batch.advantages, adv = compute_advantages(
                batch.rewards, self.cfg.rollout.n, self.cfg.algorithm.advantage
            )  # [N]
        if self.cfg.trainer.trace_every and self.step % self.cfg.trainer.trace_every == 0:
            from bandpo.run.traces import write_round_trace

            with self.timed("trace"):
                write_round_trace(
                    self.out / "traces",
                    self.step,
                    self.parts.prompts.examples,
                    drawn.round,
                    self.cfg.trainer.trace_max_chars,
                )
        return batch, {
            **reward_metrics(drawn.scores),
            **{k: float(v) for k, v in adv.items()},
            **drawn.metrics,
        }

    def old_logprobs(self, batch: TrainBatch):
        """Stage 5: ``batch.old_logprobs`` (and ``ref_logprobs`` when kl_coef > 0); returns pi_old's entropy
        [N, R] (reuse_old_logprobs: the first mini-batch's rows in stage 6; old_logprobs=rollout: None)."""
        actor = self.workers.actor
        with self.timed("logprobs"), stage("logprobs", "actor"):
            entropy = actor.old_logprobs(batch)  # [N, R]
            if self.loss.band_adaptive == "entropy":  # the per-token band radius is a function of it
                batch.old_entropy = entropy  # [N, R]
            if self.cfg.algorithm.kl_coef > 0:
                batch.ref_logprobs, _ = actor.compute_logprobs(batch, ref=True)  # [N, R]
        return entropy

    def update(self, batch: TrainBatch, entropy) -> UpdateResult | None:
        """Stage 6: the policy update, unless the batch holds a non-finite reward or log-prob (the
        guard counts the skip, or stops the run: ``trainer.on_nonfinite``); None when skipped."""
        cfg = self.cfg
        if cfg.trainer.inject_nonfinite_step == self.step:  # test hook (trainer.inject_nonfinite_step)
            inject_nonfinite(batch, cfg.trainer.inject_nonfinite)
        if self.guard.check(self.step, first_nonfinite(batch)):
            return None
        with self.timed("update"), stage("update", "actor"):
            result = self.workers.actor.update(
                batch, self.step_loss_options(batch), cfg.actor.epochs, entropy
            )
        if result.nonfinite_steps:  # the actor discarded those optimizer steps; the others were applied
            self.guard.check(
                self.step,
                f"the loss/gradients of {result.nonfinite_steps} of "
                f"{result.optimizer_steps} optimizer steps (those were not applied)",
            )
        return result

    def update_metrics(self, batch: TrainBatch, result: UpdateResult | None) -> dict[str, float]:
        """The update's ``actor/*`` metrics; with reuse_old_logprobs also pi_old's entropy and the
        rollout/actor mismatch, complete once the update's first forward filled the first rows; with
        actor.old_logprobs=rollout those of that forward, over the first mini-batch's rows."""
        if result is None:
            return {}
        first_n = self.cfg.trainer.entropy_first_n
        completed = rollout_metrics(batch, result.entropy, first_n) if self.workers.actor.reuse_old else {}
        if result.actor_logprobs is not None:  # pi_old is the engines': the actor's side is the forward
            completed = actor_metrics(batch, result.actor_logprobs, result.entropy, first_n)
        return {**completed, **{f"actor/{k}": v for k, v in result.metrics.items()}}

    def draw_ahead(self) -> Background | None:
        """The overlap stage's start: the next step's stages 1-3 on the engines' weights of now (after
        step - 1), in the background (``bandpo.trainer.overlap``); None when synchronous or last."""
        if not self.cfg.trainer.max_staleness or self.step >= self.cfg.trainer.total_steps:
            return None
        step, version = self.step + 1, self.engine_version
        return Background(lambda: InFlight(step, version, self.drawer.draw(step)), f"draw-step-{step}")

    def join_ahead(self, background: Background, actor: tuple[float, float]) -> dict[str, float]:
        """The overlap stage's end: wait for the next step's batch (kept as ``in_flight``). Returns the
        overlap's seconds: the stage's, both sides busy at once (``actor``: stages 5-6), the wait here."""
        with self.timed("overlap_wait"), stage("overlap_wait", "rollout"):
            self.in_flight = background.join()
        return {
            "time/background": background.interval[1] - background.interval[0],
            "time/overlap": overlap_seconds(background.interval, actor),
        }

    def step_loss_options(self, batch: TrainBatch) -> LossOptions:
        """The run's loss options; the adaptive entropy bonus sets this step's coefficient
        (``bandpo.algo.entropy_bonus``); the adaptive band's ``batch`` norm takes its scale from this
        step: the mean pi_old entropy over valid tokens (``bandpo.algo.adaptive``)."""
        loss = self.loss
        if self.entropy_ctl is not None:
            loss = replace(loss, entropy_coef=self.entropy_ctl.step_coef())
        if loss.band_adaptive != "entropy" or loss.entropy_norm != "batch":
            return loss
        mask = batch.response_mask.bool()  # [N, R]
        # A step whose tokens are all one-hot (entropy 0) gets delta_min everywhere.
        return replace(loss, entropy_scale=max(float(batch.old_entropy[mask].mean()), 1e-12))

    # ------------------------------------------------------------------ pieces
    def timed(self, name: str):
        """Time a step stage into ``self.timings`` (logged as ``time/<name>``)."""
        return timed_into(self.timings, name)

    def wake_engines(self, load: bool) -> None:
        """Stage 7 in order: the engines' weights wake (sleep mode), the actor's weights go into them
        (``load``), with offload the actor's own weights the transport read (ZeRO-2's bf16 copy) go to
        host memory, and only then the engines' KV cache wakes (verl / OpenRLHF order)."""
        rollout = self.workers.rollout
        rollout.wake_weights(load)
        if load:
            self.sync_weights()
        if self.workers.actor.offloads:
            self.workers.actor.offload_weights()
        rollout.wake_kv_cache()

    def sync_weights(self) -> None:
        """Actor -> rollout by ``rollout.weight_sync``'s transport (``bandpo.weight_sync.transport``):
        CUDA IPC buckets (colocated GPU), NCCL broadcast (split GPU), or node-local /dev/shm files
        (CPU; ``bandpo.weight_sync.node``: they stay between syncs, rewritten in place through the
        actor's kept mapping, and ``close`` removes them); with LoRA on vLLM the adapter alone
        (``rollout.lora_sync``). The first sync of a run, and every one with ``rollout.verify_sync``,
        is then verified (``verify_sync``)."""
        from bandpo.trainer.launch import make_sync

        if self.weight_sync is None:
            self.weight_sync = make_sync(self.cfg, self.parts.plan, self.workers)
        self.weight_sync.sync()
        self.synced_bytes = self.weight_sync.last_bytes  # logged as weight_sync/bytes
        # an adapter sync: the stale-weights check (bandpo.trainer.sync_check) stands for this one
        if (not self.synced or self.cfg.rollout.verify_sync) and not self.weight_sync.adapter_only:
            with self.timed("verify_sync"):  # within time/weight_sync too: it runs inside that stage
                self.verify_sync()
            self.synced = True

    def verify_sync(self) -> None:
        """Every engine's weights against the actor's, tensor by tensor (``bandpo.weight_sync.checksums``):
        a difference stops the run with ``WeightSyncMismatch`` naming the tensor and the engine."""
        from bandpo.weight_sync.checksums import verify_engines

        w = self.workers
        verify_engines(w.actor.workers, w.rollout.workers, float(self.cfg.rollout.weight_sync_timeout))

    def evaluate(self) -> dict:
        from bandpo.eval.evaluate import run_eval, to_eval_config

        t0 = time.perf_counter()
        with stage("eval", "rollout"):
            out = run_eval(
                self.workers.rollout,
                self.workers.scorer,
                self.parts.tokenizer,
                self.parts.eval_sets,
                to_eval_config(self.cfg.eval),
                on_samples=self._write_eval_trace if self.cfg.trainer.trace_every else None,
            )
        out["time/eval"] = time.perf_counter() - t0
        return out

    def start_probe(self) -> dict:
        """The probe's texts, sampled by the engines (the base policy) on a fresh start or read back, and
        on a fresh start the base policy's probe, for step 0 (the actor takes the devices for it and gives
        them back: colocated GPU engines sleep meanwhile); {} when the probe is off or the run resumed."""
        if self.probe is None:
            return {}
        fresh = self.step == 0
        with stage("probe", "rollout"):
            self.probe.prepare(self.workers.rollout, fresh, self.workers.actor.world_size)
        if not fresh:
            return {}
        self.enter_actor_phase()
        out = self.measure_probe()
        self.enter_rollout_phase(updated=False)
        return out

    def measure_probe(self) -> dict[str, float]:
        """``probe/*`` of the policy the actor holds now, and its seconds (``time/probe``)."""
        t0 = time.perf_counter()
        with stage("probe", "actor"):
            out = self.probe.measure(self.workers.actor)
        return {**out, "time/probe": time.perf_counter() - t0}

    def _write_eval_trace(self, samples: dict) -> None:
        from bandpo.run.traces import eval_records, write_records

        records = eval_records(self.step, samples, self.cfg.trainer.trace_max_chars)
        write_records(self.out / "traces" / f"eval_step_{self.step}.jsonl", records)

    def save(self) -> None:
        # The driver draws no random numbers of its own (the sampler and the rollout seeds are
        # functions of seed and step); each actor rank saves its RNG states with its engine.
        # max_staleness=1: the sampler is past the batch drawn ahead, which is saved with the checkpoint
        # (regenerating it would need the weights before this step's update, which are gone).
        state = {"step": self.step, "sampler": self.parts.sampler.state_dict(), "skipped": self.guard.skipped}
        if self.entropy_ctl is not None:
            state["entropy_control"] = self.entropy_ctl.state_dict()

        def write(folder: Path) -> None:
            self.workers.actor.call("save_checkpoint", str(folder))
            if self.in_flight is not None:
                save_in_flight(self.in_flight, folder.parent / IN_FLIGHT_FILE)

        with self.timed("checkpoint"), stage("checkpoint", "actor"):
            self.ckpt.save(self.step, write, state)

    def _resume(self) -> None:
        """Continue from the latest complete checkpoint, or start fresh; either way the metrics
        file then holds exactly the steps before ``self.step`` (what a killed attempt logged past
        its last checkpoint is written again)."""
        from bandpo.checkpoint.actor_state import check_files

        self.ckpt.remove_stale()
        folder = self.ckpt.latest() if self.cfg.trainer.resume != "never" else None
        if folder is None:
            self.parts.logger.truncate_after(-1)
            return
        state = self.ckpt.load_state(folder, required=("step", "sampler"))
        check_files(folder / "actor")  # a file holding code: one line here, not a worker's failure
        # colocated: the engines sleep while the states load (offload: and go back)
        with stage("resume", "actor"):
            self.workers.rollout.sleep()
            self.workers.actor.call("load_checkpoint", str(folder / "actor"))
            self.wake_engines(load=True)
        self.step, self.guard.skipped = state["step"], state.get("skipped", 0)
        if self.entropy_ctl is not None:
            self.entropy_ctl.load_state_dict(state.get("entropy_control"), str(folder / "trainer_state.json"))
        self.engine_version = self.step
        # None: the next batch is drawn at its step
        self.in_flight = load_in_flight(folder / IN_FLIGHT_FILE, in_flight_types())
        self.parts.sampler.load_state_dict(state["sampler"])
        self.parts.logger.truncate_after(self.step)
        print(f"[bandpo] resumed from {folder} at step {self.step}", flush=True)

    def close(self) -> None:
        """Tear down the workers, the metrics log and the weight sync (``bandpo.trainer.launch.close_workers``)."""
        from bandpo.trainer.launch import close_workers

        close_workers(self.workers, self.parts.logger, self.weight_sync)


def train(cfg: TrainConfig) -> dict:
    """Run training for a composed, validated config; returns the last step's metrics."""
    from bandpo.trainer.launch import close_workers, run_folder, start

    out = run_folder(cfg)
    parts = trainer = None
    try:
        parts = start(cfg, out)  # a failed start-up tears down what it started
        trainer = Trainer(cfg, parts)
        return trainer.fit()
    except WorkerFailure as e:
        ckpt = CheckpointManager(out / "checkpoints", cfg.trainer.keep_last)
        last = ckpt.latest() if ckpt.root.exists() else None
        raise WorkerFailure(f"{e}\nlast complete checkpoint: {last or 'none'}") from e
    finally:
        if trainer is not None:
            trainer.close()
        elif parts is not None:
            close_workers(parts.workers, parts.logger)
