"""The RLVR training loop (GRPO / Clip-Higher / BandPO), one named, timed stage at a time.

Per step (BandPO's recipe: GRPO's loop with the Band-clipped loss):
    1. sample      B prompts from the shuffled training set (resumable sampler)
    2. rollout     n responses per prompt from vLLM with their sampling logprobs
    3. reward      rule-based verifier: Ray actors, each with a process pool (+1 correct / -1 otherwise)
       (dynamic_sampling, DAPO, when algorithm.filter_groups.enable: rounds of 1-3 until B groups
       have varying accuracy/reward or max_gen_rounds is reached; equal-metric groups are dropped)
       sleep       colocated GPU layout only: the vLLM engines sleep (level 1) until stage 7
    4. advantages  group-normalised per prompt: (R - mean) / (std + 1e-6)
    5. logprobs    old logprobs (and entropy) from the actor, ref logprobs when kl_coef > 0
    6. update      mini-batched Band-clipped (or fixed-clipped) policy loss, DeepSpeed
    7. sync        wake the engines' weights, load the actor's into them, wake their KV cache
    8. log / eval / checkpoint

Departures from the paper's scripts, stated:
- Old logprobs are recomputed by the actor (as verl does) rather than taken from vLLM; the
  gap between the two is logged as ``health/rollout_actor_*`` instead.
- Stage 5's old-logprob pass covers only the rows of the later mini-batches (none with one
  optimizer step per rollout): the first optimizer step's own forward is the policy before
  it, so old = its detached log-probs for the batch's first ``mini_batch_prompts x n`` rows
  (ratio 1 there), and their logged entropy is that forward's (``actor.reuse_old_logprobs``:
  auto | true | false; auto is on except for the adaptive band's ``batch`` scale, which needs
  every row's pi_old entropy first). The ref pass (kl_coef > 0) still covers every row.
- Sampling is seeded per step and round (``bandpo.data.sampler.rollout_seed``) so a resumed run
  replays the exact rollouts of an uninterrupted one, dynamic sampling's extra rounds included.
- Optional, off by default: truncated importance sampling (``algorithm.tis_cap``) reweights the
  loss by min(pi_old / pi_rollout, C); entropy-adaptive Band (``algorithm.band.adaptive``) uses
  pi_old's per-token entropy from step 5; traces (``trainer.trace_every``) go to <run>/traces/.
- Non-finite rewards, logprobs or loss skip the update (counted) unless ``on_nonfinite=stop``;
  the actor never applies an optimizer step with NaN/inf gradients (``bandpo.run.nonfinite``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bandpo.actor.setup import cpu_threads_per_rank
from bandpo.algo import compute_advantages
from bandpo.data.sampler import draw_groups, rollout_seed
from bandpo.distributed import WorkerFailure, init_ray, resolve_device, stage
from bandpo.reward import check_error_share
from bandpo.run import shm
from bandpo.run.checkpoint import CheckpointManager
from bandpo.run.metrics_log import MetricsLogger
from bandpo.run.nonfinite import NonfiniteGuard, first_nonfinite, inject_nonfinite
from bandpo.run.worker_logs import setup_run_logs
from bandpo.trainer.startup import (
    SHM_PREFIX,
    clean_shm,
    ensure_model,
    live_shape,
    remove_stale_weight_files,
    stop_engines,
)
from bandpo.types import SamplingParams, TrainBatch


class Trainer:
    def __init__(self, cfg):
        from omegaconf import OmegaConf

        self.cfg = cfg
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        self.device = resolve_device(cfg.trainer.device)
        self.ckpt = CheckpointManager(self.out / "checkpoints", cfg.trainer.keep_last)
        self.timings: dict[str, float] = {}
        self.startup: dict[str, float] = {}  # start-up phase -> seconds
        self.step = 0
        self.guard = NonfiniteGuard(cfg.trainer.on_nonfinite, cfg.trainer.max_skipped_steps)
        self.weight_sync = None  # NodeWeightSync, made at the first sync
        self.plan = None  # GPU: the placement plan (bandpo.distributed.plan); None on CPU
        self.pgs: list = []  # GPU: the plan's placement groups, one per node
        self.engines_sleep = False  # colocated vLLM engines sleep during the actor's stages
        from bandpo.config import reuse_old_logprobs

        self.reuse_old = reuse_old_logprobs(cfg)  # old logprobs from the update's own forward

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from bandpo.data import EpochSampler, encode_examples, load_eval_sets
        from bandpo.data.datasets import load_source
        from bandpo.reward import RewardScheme
        from bandpo.reward.ray_scorer import RayScorer

        cfg = self.cfg
        t_setup = time.perf_counter()
        self.logs_dir = setup_run_logs(self.out, cfg.trainer.verbose)  # worker output: <run>/logs/
        with self.startup_phase("model"):
            self.model_path = ensure_model(cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        examples = [ex for src in cfg.data.train for ex in load_source(_plain(src))]
        encoded = encode_examples(self.tokenizer, examples, cfg.data.template, cfg.data.max_prompt_len)
        if not encoded.prompt_ids:
            raise ValueError(f"no training prompts left from data.train={_plain(cfg.data.train)} "
                             f"(after dropping prompts longer than data.max_prompt_len={cfg.data.max_prompt_len})")
        self.examples, self.prompts = encoded.examples, encoded.prompt_ids
        self.sampler = EpochSampler(len(self.prompts), seed=cfg.data.shuffle_seed)
        self.eval_sets = load_eval_sets(list(cfg.eval.datasets), _plain(cfg.eval.paths) or None, limit=cfg.eval.limit) \
            if cfg.trainer.eval_every or cfg.trainer.eval_before_train else {}
        r = cfg.trainer.reward
        scheme = RewardScheme(correct=r.correct, incorrect=r.incorrect, format_penalty=r.format_penalty,
                              overlong_buffer=r.overlong_buffer, overlong_penalty=r.overlong_penalty,
                              max_response_len=cfg.rollout.max_tokens)
        remove_stale_weight_files()
        shm_before = clean_shm(self.out)
        with self.startup_phase("ray"):
            init_ray(cfg.trainer.ray_address, self.device, self.logs_dir)
            self.plan = self._placement_plan()

        def start_verifier():  # verifier actors, each with its own grading pool
            with stage("start", "verifier"):
                self.scorer = RayScorer(scheme, answer_format=cfg.data.answer_format,
                                        num_workers=cfg.trainer.verifier_workers, timeout=cfg.trainer.verifier_timeout,
                                        actors=cfg.trainer.verifier_actors, strategies=self._verifier_strategies(),
                                        memory_cap_gib=cfg.trainer.verifier_memory_gib)

        self._start_workers(start_verifier)
        shm.record_new_entries(self.out, shm_before)  # vLLM's queues: removed by the next start if we die
        self._report_startup(time.perf_counter() - t_setup)
        self.logger = MetricsLogger(self.out, cfg.trainer.total_steps, _plain(cfg.trainer.wandb), _plain(cfg))

    def _report_startup(self, total: float) -> None:
        """One console line and <run>/startup.json: seconds per start-up phase.

        ``verifier`` overlaps the engines' and the actor's loading; ``rollout`` / ``actor`` are the
        waits left after it. ``process`` is the time from interpreter start to ``setup`` (imports).
        """
        import json

        self.startup["setup"] = total
        import psutil  # a Ray dependency

        self.startup["process"] = time.time() - psutil.Process().create_time() - total
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.startup.items() if k not in ("setup", "process"))
        print(f"[bandpo] start-up {total:.1f} s ({parts}; before setup {self.startup['process']:.1f} s)", flush=True)
        (self.out / "startup.json").write_text(json.dumps({k: round(v, 3) for k, v in self.startup.items()}))

    def _placement_plan(self):
        """The GPU placement plan for the live cluster (``bandpo.distributed.plan``); None on CPU.

        The shape is ``trainer.nnodes`` x ``trainer.gpus_per_node`` when the config gives it, else
        the GPU nodes Ray reports; a plan that does not fit raises ``ConfigError`` naming the keys.
        """
        if self.device != "cuda":
            return None
        from bandpo.distributed.plan import make_plan, shape_from_config

        return make_plan(self.cfg, shape_from_config(self.cfg) or live_shape(), "cuda")

    def _verifier_strategies(self) -> list | None:
        """Verifier actors' scheduling strategies from the plan (None: ``RayScorer``'s own, as on CPU)."""
        if self.plan is None or self.cfg.trainer.verifier_actors == "per_node":
            return None  # per_node pins one actor to every node itself
        from bandpo.distributed.placement import verifier_options

        return [verifier_options(self.plan, i)["scheduling_strategy"] for i in range(len(self.plan.of("verifier")))]

    def _start_workers(self, start_verifier) -> None:
        """Start the rollout engines, the actor ranks and (``start_verifier``) the verifier, overlapped.

        Ray builds actors in the background: the engines and the actor ranks are launched
        first, the verifier starts while they load, then each group is waited for under its
        own stage, so a failure names its group (and ``close`` tears the others down). One
        exception: in the colocated GPU layout vLLM sizes its KV cache from the GPU memory free
        when it starts, so the actor ranks are launched only once the engines are up.
        """
        import ray

        from bandpo.actor import ActorGroup
        from bandpo.rollout.worker import spawn_rollout_workers

        cfg, gpu = self.cfg, self.device == "cuda"
        ro, ac = cfg.rollout, cfg.actor
        # CPU: the engine core and its one worker run inside the rollout actor's process (no
        # engine-core or worker process to spawn, each re-importing torch and vLLM: ~20 s of a
        # 2-core start-up).
        # CPU: the engines generate while the actor waits, so they share all cores (Ray would give
        # each one thread: its num_cpus=1).
        env = {"VLLM_CPU_KVCACHE_SPACE": str(ro.kv_cache_gib), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "OMP_NUM_THREADS": str(cpu_threads_per_rank(ro.num_workers))} if not gpu else None
        placed: dict = {}  # GPU: the plan's Ray options per engine / actor rank
        if gpu:
            from bandpo.distributed.placement import actor_options, create_placement_groups, engine_launch

            with stage("start", "placement"):
                self.pgs = create_placement_groups(self.plan)
            launches = [engine_launch(self.plan, self.pgs, e) for e in range(ro.num_workers)]
            placed = dict(options_per_worker=[o for o, _, _ in launches], env_per_worker=[v for _, v, _ in launches])
            actor_opts = [actor_options(self.plan, self.pgs, r) for r in range(ac.num_workers)]
        with stage("start", "rollout"):
            engine_kw = dict(max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                             enforce_eager=(not gpu) if ro.enforce_eager == "auto" else bool(ro.enforce_eager))
            if gpu:
                sleep = self.plan.sleeps if ro.enable_sleep_mode == "auto" else bool(ro.enable_sleep_mode)
                self.engines_sleep = sleep and ro.backend == "vllm"  # the HF engine has no sleep mode
                engine_kw.update(tensor_parallel_size=ro.tensor_parallel_size,
                                 gpu_memory_utilization=ro.gpu_memory_utilization, enable_sleep_mode=sleep,
                                 **launches[0][2])  # TP > 1: vLLM's Ray executor in the engine's bundles
            if ro.backend == "vllm" and not gpu:
                # vllm-cpu 0.32 crashes on seeded requests whose prefill is split across steps
                # ("CPU Generator does not use offset"); unsplit prefills avoid it.
                engine_kw.update(kv_cache_gib=ro.kv_cache_gib, enable_chunked_prefill=False, distributed_executor_backend="uni",
                                 max_num_batched_tokens=max(8192, cfg.model.max_model_len))
            self.rollout = spawn_rollout_workers(ro.num_workers, ro.backend, self.model_path, num_cpus=1, num_gpus=0,
                                                 env=env, wait=False, **placed, **engine_kw)
            engines_ready = [w.ready.remote() for w in self.rollout]
        if self.plan is not None and self.plan.sleeps:
            with self.startup_phase("rollout"), stage("start", "rollout"):
                ray.get(engines_ready)
        with stage("start", "actor"):
            bf16 = gpu if ac.bf16 == "auto" else bool(ac.bf16)
            self.actor = ActorGroup(
                self.model_path, ac.num_workers, num_cpus_per_rank=1, num_gpus_per_rank=0,
                options_per_rank=actor_opts if gpu else None,
                zero_stage=ac.zero_stage, lr=ac.lr, betas=tuple(ac.betas), weight_decay=ac.weight_decay,
                warmup_steps=ac.warmup_steps, grad_clip=ac.grad_clip, bf16=bf16,
                gradient_checkpointing=ac.gradient_checkpointing or cfg.model.get("gradient_checkpointing", False),
                mini_batch_size=ac.mini_batch_prompts * ro.n, micro_batch_size=ac.micro_batch_size,
                logprob_token_budget=ac.logprob_token_budget, padding_free=ac.padding_free,
                max_tokens_per_micro_batch=ac.max_tokens_per_micro_batch,
                logits_chunk_tokens=ac.logits_chunk_tokens, share_prompts=ac.share_prompts,
                ref_model=cfg.algorithm.kl_coef > 0,
                temperature=ro.temperature, seed=cfg.trainer.seed, cpu_threads=ac.cpu_threads, wait=False)
        with self.startup_phase("verifier"):
            start_verifier()
        with self.startup_phase("rollout"), stage("start", "rollout"):
            ray.get(engines_ready)
        with self.startup_phase("actor"), stage("start", "actor"):
            self.actor.wait_ready()

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        cfg = self.cfg
        self._resume()
        if self.step == 0 and cfg.trainer.eval_before_train and self.eval_sets:
            self.logger.log(0, self.evaluate())
        last: dict = {}
        while self.step < cfg.trainer.total_steps:
            self.step += 1
            last = self.train_step()
            if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0 and self.eval_sets:
                last.update(self.evaluate())
            self.logger.log(self.step, last)
            if cfg.trainer.save_every and (self.step % cfg.trainer.save_every == 0 or self.step == cfg.trainer.total_steps):
                self.save()
        if cfg.trainer.export_hf:
            with stage("export", "actor"):
                self.actor.call("export_hf", str(self.out / "hf"))
        if self.eval_sets and not (cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0):
            final = self.evaluate()
            self.logger.log(self.step, {"final": True, **final})
            last.update(final)
        return last

    def train_step(self) -> dict:
        cfg, ro, algo = self.cfg, self.cfg.rollout, self.cfg.algorithm
        # A checkpoint is written after its step's metrics line, so its time goes on the next line.
        last_checkpoint = self.timings.get("checkpoint")
        self.timings = {}
        t_step = time.perf_counter()

        if algo.filter_groups.enable:  # DAPO: rounds of sample/rollout/reward until enough groups vary
            with self.timed("dynamic_sampling"):
                rnd, filter_metrics = self._rollout_filtered()
        else:
            rnd, filter_metrics = self._rollout_round(cfg.trainer.prompts_per_step, 0), {}
        batch, scores = rnd.batch, rnd.scores
        self.sleep_rollout()  # colocated GPU layout: free the GPUs for the actor's stages
        lengths = batch.response_lengths  # [N]
        with self.timed("advantages"):
            _check_groups(batch.prompt_index, len(rnd.idx), ro.n)
            batch.advantages, adv_metrics = compute_advantages(batch.rewards, ro.n, algo.advantage)  # [N]
        if cfg.trainer.trace_every and self.step % cfg.trainer.trace_every == 0:
            with self.timed("trace"):
                self._write_trace(rnd)
        first = cfg.actor.mini_batch_prompts * ro.n  # rows of the first optimizer step
        with self.timed("logprobs"), stage("logprobs", "actor"):
            entropy = later_entropy = None  # [N, R]: every row's (for the metrics); the later rows' only
            if not self.reuse_old:
                batch.old_logprobs, entropy = self.actor.compute_logprobs(batch, with_entropy=True)  # [N, R] x2
            elif first < batch.size:  # the first `first` rows' come from the update's first forward
                batch.old_logprobs, later_entropy = _later_rows_logprobs(self.actor, batch, first)  # [N, R] x2
            if self._adaptive_band():  # the per-token band radius is a function of pi_old's entropy
                # [N, R]; with reuse_old_logprobs the first step's rows take their forward's entropy
                batch.old_entropy = entropy if entropy is not None else later_entropy
            if algo.kl_coef > 0:
                batch.ref_logprobs, _ = self.actor.compute_logprobs(batch, ref=True)  # [N, R]

        # Rewards and throughput count every generated response (dropped rounds too).
        all_scores = filter_metrics.pop("all_scores", scores)
        gen_tokens = filter_metrics.pop("gen_tokens", int(lengths.sum()))
        metrics = {**_reward_metrics(all_scores), **{k: float(v) for k, v in adv_metrics.items()}, **filter_metrics}
        metrics.update(_rollout_metrics(batch, entropy))
        if cfg.trainer.inject_nonfinite_step == self.step:  # test hook, see configs/trainer/default.yaml
            inject_nonfinite(batch, cfg.trainer.inject_nonfinite)
        updated = not self.guard.check(self.step, first_nonfinite(batch))
        if updated:
            with self.timed("update"), stage("update", "actor"):
                bad_steps = total_steps = 0
                for epoch in range(cfg.actor.epochs):
                    if self.reuse_old and epoch == 0:  # the first step's rows' old logprobs come from its forward
                        update, first_old, first_entropy = self.actor.update_on_policy(batch, self.loss_kwargs(batch))
                        batch.old_logprobs = _merge_first_rows(first_old, batch.old_logprobs, first)  # [N, R]
                        entropy = _merge_first_rows(first_entropy, later_entropy, first)
                        metrics.update(_rollout_metrics(batch, entropy))
                    else:
                        update = self.actor.update(batch, self.loss_kwargs(batch))
                    bad_steps += int(update["nonfinite_steps"])
                    total_steps += int(update["optimizer_steps"])
                metrics.update({f"actor/{k}": v for k, v in update.items()})
            if bad_steps:  # the actor discarded those optimizer steps; the others were applied: sync anyway
                self.guard.check(self.step, f"the loss/gradients of {bad_steps} of {total_steps} optimizer "
                                            f"steps (those were not applied)")
        if updated or self.engines_sleep:  # the engines wake for the next rollout / evaluation
            with self.timed("weight_sync"), stage("weight_sync", "actor/rollout"):
                self.wake_rollout(sync=updated)
        metrics["trainer/skipped_steps"] = self.guard.skipped
        step_time = time.perf_counter() - t_step
        metrics.update({f"time/{k}": v for k, v in self.timings.items()})
        metrics["time/step"] = step_time
        if last_checkpoint is not None:
            metrics["time/last_checkpoint"] = last_checkpoint
        metrics["perf/tokens_per_s"] = gen_tokens / step_time
        metrics["perf/rollout_tokens_per_s"] = gen_tokens / max(self.timings["rollout"], 1e-9)
        return metrics

    def loss_kwargs(self, batch: TrainBatch | None = None) -> dict:
        """``policy_loss`` options of this run; ``batch`` (with old_entropy) sets the adaptive band's
        per-step entropy scale."""
        a = self.cfg.algorithm
        kw = dict(algorithm=a.name, eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, agg=a.loss_agg,
                  max_len=self.cfg.rollout.max_tokens, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                  entropy_coef=a.entropy_coef)
        if a.name == "bandpo":
            kw.update(divergence=a.band.divergence, delta=a.band.delta, upper_cap=a.band.upper_cap,
                      relax_high_p=a.band.relax_high_p)
        if a.get("tis_cap") is not None:
            kw["tis_cap"] = float(a.tis_cap)
        if self._adaptive_band() and batch is not None:
            kw.update(self._adaptive_band_kwargs(batch))
        return kw

    def _adaptive_band(self) -> bool:
        band = self.cfg.algorithm.get("band")
        return band is not None and band.get("adaptive", "none") == "entropy"

    def _adaptive_band_kwargs(self, batch: TrainBatch) -> dict:
        """Entropy-adaptive band options; the scale is the step's mean valid-token entropy (batch)
        or log V (logv), the same for every micro-batch (bandpo.algo.adaptive)."""
        from bandpo.config import band_delta_range

        band = self.cfg.algorithm.band
        lo, hi = band_delta_range(band)
        if band.adaptive_norm == "logv":
            if not hasattr(self, "_log_vocab"):
                from transformers import AutoConfig

                self._log_vocab = math.log(AutoConfig.from_pretrained(self.model_path).vocab_size)
            scale = self._log_vocab
        else:
            mask = batch.response_mask.bool()  # [N, R]
            # A step whose tokens are all one-hot (entropy 0) gets delta_min everywhere.
            scale = max(float(batch.old_entropy[mask].mean()), 1e-12)
        return dict(band_adaptive="entropy", delta_min=lo, delta_max=hi, entropy_norm=band.adaptive_norm,
                    entropy_scale=scale)

    # ------------------------------------------------------------------ rollout rounds
    def _rollout_round(self, num_prompts: int, round_: int) -> _Round:
        """Steps 1-3 for one round: sample prompts, roll them out (seed of (seed, step, round)), reward."""
        cfg, ro = self.cfg, self.cfg.rollout
        with self.timed("sample"):
            idx = self.sampler.next_batch(num_prompts)
            prompts = [self.prompts[i] for i in idx]
            answers = [self.examples[i].answer for i in idx]
        with self.timed("rollout"), stage("rollout", "rollout"):
            rollout = self._generate(prompts, SamplingParams(
                n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, max_tokens=ro.max_tokens,
                seed=rollout_seed(cfg.trainer.seed, self.step, round_)))
        batch = TrainBatch.from_rollout(rollout)
        with self.timed("reward"):
            _, responses, _ = batch.to_lists()
            texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            gold = [answers[i] for i in batch.prompt_index.tolist()]
            scores = self.scorer.score(texts, gold, batch.response_lengths.tolist())
            check_error_share([s.status for s in scores], self.cfg.trainer.max_error_share,
                              f"step {self.step} round {round_}")
            batch.rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32)  # [N]
        return _Round(idx, batch, texts, scores)

    def _rollout_filtered(self) -> tuple[_Round, dict]:
        """DAPO dynamic sampling: drop groups whose metric (accuracy or reward) is all equal, and run
        more rounds until ``prompts_per_step`` groups vary or ``max_gen_rounds`` is reached.

        Short of groups, it trains on what there is, cut to a multiple of ``actor.mini_batch_prompts``
        (the update's unit); with fewer varying groups than one mini-batch, the mini-batch is filled
        with equal-metric groups (advantage 0: no policy gradient, only the KL term). Both are logged.
        """
        cfg, fg = self.cfg, self.cfg.algorithm.filter_groups
        n, need = cfg.rollout.n, cfg.trainer.prompts_per_step
        rounds: list[_Round] = []

        def run_round(r: int) -> list[bool]:
            rounds.append(self._rollout_round(need, r))
            rnd = rounds[-1]
            _check_groups(rnd.batch.prompt_index, len(rnd.idx), n)
            if fg.metric == "acc":
                values = torch.tensor([float(s.correct) for s in rnd.scores])  # [N]
            else:
                values = rnd.batch.rewards  # [N]
            grouped = values.view(-1, n)  # [B, G]
            return (grouped.amax(1) != grouped.amin(1)).tolist()

        draw = draw_groups(need, fg.max_gen_rounds, run_round)
        mini = cfg.actor.mini_batch_prompts
        chosen = draw.kept[: len(draw.kept) - len(draw.kept) % mini]
        padded = draw.flat[: mini - len(chosen)] if not chosen else []
        out = _Round.gather(rounds, chosen + padded, n)
        metrics = {
            "filter/rounds": draw.rounds, "filter/prompts_drawn": draw.drawn,
            "filter/kept_frac": draw.informative / draw.drawn, "filter/groups_trained": len(out.idx),
            "filter/short_groups": need - len(chosen), "filter/padded_groups": len(padded),
            "all_scores": [s for r in rounds for s in r.scores],
            "gen_tokens": sum(int(r.batch.response_lengths.sum()) for r in rounds),
        }
        if len(chosen) < need:
            print(f"[bandpo] step {self.step}: dynamic sampling found {draw.informative} varying groups of {need} "
                  f"in {draw.rounds} rounds (algorithm.filter_groups.max_gen_rounds={fg.max_gen_rounds}); "
                  f"training on {len(chosen)} (+{len(padded)} equal-metric)", file=sys.stderr, flush=True)
        return out, metrics

    def _write_trace(self, rnd: _Round) -> None:
        from bandpo.run.traces import group_records, write_records

        ex = [self.examples[i] for i in rnd.idx]
        b = rnd.batch
        records = group_records(
            self.step, [e.id for e in ex], [e.problem for e in ex], [e.answer for e in ex], rnd.texts, rnd.scores,
            b.advantages.tolist(), b.prompt_index.tolist(), b.response_lengths.tolist(), b.finish_reasons,
            self.cfg.trainer.trace_max_chars)
        write_records(self.out / "traces" / f"step_{self.step}.jsonl", records)

    # ------------------------------------------------------------------ pieces
    def startup_phase(self, name: str):
        """Time a start-up phase into ``self.startup`` (printed and written to <run>/startup.json)."""
        return _timed_into(self.startup, name)

    def timed(self, name: str):
        """Time a step stage into ``self.timings`` (logged as ``time/<name>``)."""
        return _timed_into(self.timings, name)

    def _generate(self, prompts, sampling):
        from bandpo.rollout.worker import generate_on_workers

        return generate_on_workers(self.rollout, prompts, sampling)

    def sleep_rollout(self) -> None:
        """Colocated: every engine sleeps (level 1: weights offloaded to CPU, KV cache freed) so the
        actor's logprobs and update get the GPUs; no-op otherwise."""
        if self.engines_sleep:
            with self.timed("sleep"), stage("sleep", "rollout"):
                self._call_engines("sleep")

    def wake_rollout(self, sync: bool) -> None:
        """Before the next rollout or evaluation: weights back on the GPU, the actor's weights loaded
        into them (``sync``), then the KV cache (verl / OpenRLHF order: the KV cache is reallocated
        only once the sync's buffers are gone). Without sleep mode only the sync runs."""
        if self.engines_sleep:
            self._call_engines("wake_up", ["weights"])
        if sync:
            self.sync_weights()
        if self.engines_sleep:
            self._call_engines("wake_up", ["kv_cache"])

    def _call_engines(self, method: str, *args) -> None:
        """``method(*args)`` on every rollout worker at once; returns when all are done."""
        import ray

        ray.get([getattr(w, method).remote(*args) for w in self.rollout])

    def sync_weights(self) -> None:
        """Actor -> rollout: the lowest actor rank on each node writes one flat buffer in that node's
        /dev/shm, and every engine loads its own node's (``bandpo.weight_sync.node``).

        The files stay between syncs (``close`` removes them; a killed run's is removed by the next
        start): rewriting one through the actor's kept mapping costs half of writing a new one
        (no fresh tmpfs pages to fault in; scripts/bench_rollout.py, ``new/sync``).
        """
        from bandpo.weight_sync.node import NodeWeightSync

        if self.weight_sync is None:
            self.weight_sync = NodeWeightSync(self.actor.workers, self.rollout, f"{SHM_PREFIX}{os.getpid()}")
        self.weight_sync.sync()

    def evaluate(self) -> dict:
        from bandpo.eval.evaluate import run_eval

        t0 = time.perf_counter()
        with stage("eval", "rollout"):
            out = run_eval(_WorkersEngine(self.rollout), self.scorer, self.tokenizer, self.eval_sets, self.cfg.eval,
                           on_samples=self._write_eval_trace if self.cfg.trainer.trace_every else None)
        out["time/eval"] = time.perf_counter() - t0
        return out

    def _write_eval_trace(self, samples: dict) -> None:
        from bandpo.run.traces import eval_records, write_records

        records = eval_records(self.step, samples, self.cfg.trainer.trace_max_chars)
        write_records(self.out / "traces" / f"eval_step_{self.step}.jsonl", records)

    def save(self) -> None:
        # The driver draws no random numbers of its own (the sampler and the rollout seeds are
        # functions of seed and step); each actor rank saves its RNG states with its engine.
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "skipped": self.guard.skipped}
        with self.timed("checkpoint"), stage("checkpoint", "actor"):
            self.ckpt.save(self.step, lambda folder: self.actor.call("save_checkpoint", str(folder)), state)

    def _resume(self) -> None:
        """Continue from the latest complete checkpoint, or start fresh; either way the metrics
        file then holds exactly the steps before ``self.step`` (what a killed attempt logged past
        its last checkpoint is written again)."""
        self.ckpt.remove_stale()
        folder = self.ckpt.latest() if self.cfg.trainer.resume != "never" else None
        if folder is None:
            self.logger.truncate_after(-1)
            return
        state = self.ckpt.load_state(folder, required=("step", "sampler"))
        with stage("resume", "actor"):
            self.actor.call("load_checkpoint", str(folder / "actor"))
            self.sync_weights()
        self.step, self.guard.skipped = state["step"], state.get("skipped", 0)
        self.sampler.load_state_dict(state["sampler"])
        self.logger.truncate_after(self.step)
        print(f"[bandpo] resumed from {folder} at step {self.step}", flush=True)

    def close(self) -> None:
        import ray

        for closer in (getattr(self, "scorer", None), getattr(self, "logger", None), self.weight_sync):
            if closer is not None:
                closer.close()
        if ray.is_initialized():
            stop_engines(getattr(self, "rollout", []))
            if self.pgs:
                from bandpo.distributed.placement import remove_placement_groups

                remove_placement_groups(self.pgs)
            ray.shutdown()


@dataclass
class _Round:
    """One rollout round: the prompts' example indices [B], the batch [B*G rows] with rewards, the
    decoded responses and their scores [B*G]."""

    idx: list[int]
    batch: TrainBatch
    texts: list[str]
    scores: list

    @classmethod
    def gather(cls, rounds: list[_Round], groups: list[tuple[int, int]], n: int) -> _Round:
        """The (round, group) groups of ``rounds``, in that order, as one round (prompt_index renumbered)."""
        parts, idx, texts, scores = [], [], [], []
        for r, g in groups:
            rnd = rounds[r]
            rows = slice(g * n, (g + 1) * n)  # groups are contiguous (checked by _check_groups)
            parts.append(rnd.batch.select(rows))
            idx.append(rnd.idx[g])
            texts.extend(rnd.texts[rows])
            scores.extend(rnd.scores[rows])
        batch = TrainBatch.concat(parts)
        batch.prompt_index = torch.arange(len(groups)).repeat_interleave(n)  # [B*G]
        batch.rewards = torch.cat([p.rewards for p in parts])  # [B*G]
        return cls(idx, batch, texts, scores)


class _WorkersEngine:
    """The rollout workers seen as one ``RolloutEngine`` (for evaluation)."""

    def __init__(self, workers):
        self.workers = workers

    def generate(self, prompt_token_ids, sampling):
        from bandpo.rollout.worker import generate_on_workers

        return generate_on_workers(self.workers, prompt_token_ids, sampling)


def _plain(node):
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def _check_groups(prompt_index: torch.Tensor, num_prompts: int, n: int) -> None:
    """Advantages normalise over consecutive groups of n rows: each prompt's n responses in prompt order."""
    expected = torch.arange(num_prompts).repeat_interleave(n)  # [B*G]
    if not torch.equal(prompt_index.cpu(), expected):
        raise RuntimeError(f"rollout rows are not {num_prompts} contiguous groups of rollout.n={n} in prompt "
                           f"order (prompt_index starts {prompt_index[:2 * n].tolist()})")


def _reward_metrics(scores) -> dict[str, float]:
    from collections import Counter

    n = max(len(scores), 1)
    counts = Counter(s.status for s in scores)
    out = {"reward/mean": sum(s.reward for s in scores) / n, "reward/accuracy": sum(s.correct for s in scores) / n}
    out.update({f"reward/frac_{status}": c / n for status, c in counts.items()})
    return out


@contextmanager
def _timed_into(table: dict[str, float], name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        table[name] = table.get(name, 0.0) + time.perf_counter() - t0


def _later_rows_logprobs(actor, batch: TrainBatch, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Old log-probs and entropy [N, R] of rows ``first..N`` from the actor; 0.0 in rows ``0..first``
    (the update's first forward fills those: ``actor.reuse_old_logprobs``)."""
    lp, ent = actor.compute_logprobs(batch.select(slice(first, None)), with_entropy=True)  # [N - first, R] x2
    pad = torch.zeros(first, lp.shape[1], dtype=lp.dtype)
    return torch.cat([pad, lp]), torch.cat([pad, ent])


def _merge_first_rows(first_rows: torch.Tensor, later: torch.Tensor | None, first: int) -> torch.Tensor:
    """[N, R]: ``later`` (``_later_rows_logprobs``'s, written in place) with rows ``0..first`` from
    ``first_rows`` (the update's forward); ``first_rows`` itself when there are no later rows."""
    if later is None:
        return first_rows
    later[:first] = first_rows[:first]
    return later


def _rollout_metrics(batch: TrainBatch, entropy: torch.Tensor | None) -> dict[str, float]:
    """Response lengths; with the actor's old logprobs and entropy [N, R] also their health metrics
    (absent until the update's forward made them, with reuse_old_logprobs)."""
    mask = batch.response_mask.bool()  # [N, R]
    lengths = batch.response_lengths.float()  # [N]
    out = {
        "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(f == "length" for f in batch.finish_reasons) / max(batch.size, 1),
    }
    if entropy is None or batch.old_logprobs is None:
        return out
    diff = (batch.rollout_logprobs - batch.old_logprobs)[mask]  # log pi_rollout - log pi_actor, same tokens
    return {
        **out,
        "actor/entropy": entropy[mask].mean().item(),
        "health/rollout_actor_abs_diff": diff.abs().mean().item(),
        # k3 estimate of KL(pi_rollout || pi_actor) from the rollout's own samples.
        "health/rollout_actor_kl": (torch.exp(-diff) - 1 + diff).mean().item(),
    }


def train(cfg) -> dict:
    """Run training for a composed, validated config; returns the last step's metrics."""
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        return trainer.fit()
    except WorkerFailure as e:
        last = trainer.ckpt.latest() if trainer.ckpt.root.exists() else None
        raise WorkerFailure(f"{e}\nlast complete checkpoint: {last or 'none'}") from e
    finally:
        trainer.close()
