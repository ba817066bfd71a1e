"""Stages 1-3 of a step: sample prompts, roll them out, grade them; with DAPO's dynamic sampling, in rounds.

Dynamic sampling (DAPO, ``algorithm.filter_groups.enable``) drops prompt groups whose metric
(accuracy or reward) is the same for all n responses (advantage 0: no policy gradient) and runs
more rounds until ``trainer.prompts_per_step`` groups vary or ``max_gen_rounds`` is reached. With the
random reward (``trainer.reward.random_p``) both metrics are the random reward's, which is what trains.
Round r of step s samples with ``rollout_seed(seed, s, r)``, so a resumed run replays every round.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bandpo.config.checks import check_max_gen_rounds
from bandpo.data.sampler import rollout_seed
from bandpo.distributed import stage
from bandpo.errors import check_number
from bandpo.parts import reward_scheme
from bandpo.reward.checks import check_error_share
from bandpo.reward.scheme import random_positive, random_rewards
from bandpo.types import SamplingParams, TrainBatch

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig


@dataclass
class Round:
    """One rollout round: the prompts' example indices [B], the batch [N] with rewards, the decoded
    responses and their scores [N]."""

    idx: list[int]
    batch: TrainBatch
    texts: list[str]
    scores: list

    @classmethod
    def gather(cls, rounds: list[Round], groups: list[tuple[int, int]], n: int) -> Round:
        """The (round, group) groups of ``rounds``, in that order, as one round (prompt_index renumbered)."""
        parts, idx, texts, scores = [], [], [], []
        for r, g in groups:
            rnd = rounds[r]
            rows = slice(g * n, (g + 1) * n)  # groups are contiguous (checked by check_groups)
            parts.append(rnd.batch.select(rows))
            idx.append(rnd.idx[g])
            texts.extend(rnd.texts[rows])
            scores.extend(rnd.scores[rows])
        batch = TrainBatch.concat(parts)
        batch.prompt_index = torch.arange(len(groups)).repeat_interleave(n)  # [N]
        batch.rewards = torch.cat([p.rewards for p in parts])  # [N]
        return cls(idx, batch, texts, scores)


@dataclass
class Drawn:
    """A drawn batch: what a step trains on, and what it generated to get there (dropped rounds
    included). ``Drawn`` and ``Round`` keep their names: checkpoints pickle them (in_flight.pt)."""

    round: Round
    metrics: dict[str, float]  # filter/* with dynamic sampling, else empty
    scores: list  # every generated response's score
    gen_tokens: int  # every generated response token


@dataclass
class GroupSelection:
    """Which prompt groups of which rounds a step trains on (``draw_groups``)."""

    rounds: int  # rollout rounds run
    kept: list[tuple[int, int]]  # (round, group in round) of informative groups, draw order, at most `need`
    flat: list[tuple[int, int]]  # (round, group) of groups whose metric was all equal, draw order
    informative: int  # informative groups seen (may exceed `need`; the surplus is dropped)
    drawn: int  # groups (prompts) drawn


def draw_groups(need: int, max_rounds: int, run_round: Callable[[int], Sequence[bool]]) -> GroupSelection:
    """DAPO dynamic sampling's control loop: run rounds until ``need`` informative groups or ``max_rounds``.

    ``run_round(r)`` draws the next prompts from the (resumable) sampler, rolls them out and
    rewards them with round ``r``'s seed, and returns per group whether its metric varies. The
    outcome is a function of the sampler's state and the seeds, so a resumed run replays it.
    """
    check_number(need, "need", low=1, integer=True)
    check_max_gen_rounds(max_rounds, "max_rounds")
    kept: list[tuple[int, int]] = []
    flat: list[tuple[int, int]] = []
    drawn = informative = 0
    for r in range(max_rounds):
        flags = list(run_round(r))
        drawn += len(flags)
        for g, ok in enumerate(flags):
            (kept if ok else flat).append((r, g))
        informative = len(kept)
        if informative >= need:
            break
    return GroupSelection(rounds=r + 1, kept=kept[:need], flat=flat, informative=informative, drawn=drawn)


def check_groups(prompt_index: torch.Tensor, num_prompts: int, n: int) -> None:
    """Advantages normalise over consecutive groups of n rows: each prompt's n responses in prompt order."""
    expected = torch.arange(num_prompts).repeat_interleave(n)  # [N]
    if not torch.equal(prompt_index.cpu(), expected):
        raise RuntimeError(
            f"rollout rows are not {num_prompts} contiguous groups of rollout.n={n} in prompt "
            f"order (prompt_index starts {prompt_index[: 2 * n].tolist()})"
        )


class BatchDrawer:
    """Draws a step's batch: ``sampler`` picks indices into ``prompts`` (token ids) and ``answers``
    (gold), ``rollout`` generates (a ``RolloutGroup``), ``scorer`` grades the decoded responses.
    ``timed(name)`` times a stage into the step's ``time/<name>``."""

    def __init__(self, cfg: TrainConfig, sampler, prompts, answers, rollout, scorer, tokenizer, timed):
        self.cfg, self.sampler, self.prompts, self.answers = cfg, sampler, prompts, answers
        self.rollout, self.scorer, self.tokenizer, self.timed = rollout, scorer, tokenizer, timed
        self.scheme = reward_scheme(cfg)  # the random reward's values (trainer.reward.random_p)

    def draw(self, step: int) -> Drawn:
        """Stages 1-3 of ``step``: one round, or rounds of dynamic sampling when it is on."""
        if self.cfg.algorithm.filter_groups.enable:
            with self.timed("dynamic_sampling"):
                return self._filtered(step)
        rnd = self.round(step, 0, self.cfg.trainer.prompts_per_step)
        return Drawn(
            rnd, self._random_metrics(step, [rnd]), rnd.scores, int(rnd.batch.response_lengths.sum())
        )

    def positive(self, step: int, round_: int, rnd: Round) -> list[bool]:
        """Which of ``rnd``'s responses count as correct: the grading's, or with ``trainer.reward.random_p``
        the random reward's draw (what its rewards were made from, so dynamic sampling sees them)."""
        p = self.cfg.trainer.reward.random_p
        if p is None:
            return [s.correct for s in rnd.scores]
        return random_positive(len(rnd.scores), p, self.cfg.trainer.seed, step, round_)

    def _random_metrics(self, step: int, rounds: list[Round]) -> dict[str, float]:
        """``reward/random_frac_positive`` over every response the step generated (as ``reward/accuracy``,
        which stays the grading's), with ``trainer.reward.random_p``; else nothing."""
        if self.cfg.trainer.reward.random_p is None:
            return {}
        hits = [h for r, rnd in enumerate(rounds) for h in self.positive(step, r, rnd)]
        return {"reward/random_frac_positive": sum(hits) / max(len(hits), 1)}

    def round(self, step: int, round_: int, num_prompts: int) -> Round:
        """Sample ``num_prompts`` prompts, roll them out (seed of (seed, step, round)), reward them."""
        cfg, ro = self.cfg, self.cfg.rollout
        with self.timed("sample"):
            idx = self.sampler.next_batch(num_prompts)
            prompts = [self.prompts[i] for i in idx]
            answers = [self.answers[i] for i in idx]
        with self.timed("rollout"), stage("rollout", "rollout"):
            rollout = self.rollout.generate(
                prompts,
                SamplingParams(
                    n=ro.n,
                    temperature=ro.temperature,
                    top_p=ro.top_p,
                    top_k=ro.top_k,
                    max_tokens=ro.max_tokens,
                    seed=rollout_seed(cfg.trainer.seed, step, round_),
                ),
            )
        batch = TrainBatch.from_rollout(rollout)
        with self.timed("reward"):
            _, responses, _ = batch.to_lists()
            texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            gold = [answers[i] for i in batch.prompt_index.tolist()]
            scores = self.scorer.score(texts, gold, batch.response_lengths.tolist())
            check_error_share(
                [s.status for s in scores], cfg.trainer.max_error_share, f"step {step} round {round_}"
            )
            rewards = [s.reward for s in scores]
            p = cfg.trainer.reward.random_p
            if p is not None:  # diagnostics: a reward independent of the answer; the scores keep the grading
                lengths = batch.response_lengths.tolist()
                rewards = random_rewards(len(scores), p, cfg.trainer.seed, step, self.scheme, lengths, round_)
            batch.rewards = torch.tensor(rewards, dtype=torch.float32)  # [N]
        return Round(idx, batch, texts, scores)

    def _filtered(self, step: int) -> Drawn:
        """Rounds until ``prompts_per_step`` groups vary or ``max_gen_rounds``.

        Short of groups, it trains on what there is, cut to a multiple of ``actor.mini_batch_prompts``
        (the update's unit); with fewer varying groups than one mini-batch, the mini-batch is filled
        with equal-metric groups (advantage 0: no policy gradient, only the KL term). Both are logged.
        """
        cfg, fg = self.cfg, self.cfg.algorithm.filter_groups
        n, need = cfg.rollout.n, cfg.trainer.prompts_per_step
        rounds: list[Round] = []

        def run_round(r: int) -> list[bool]:
            rounds.append(self.round(step, r, need))
            rnd = rounds[-1]
            check_groups(rnd.batch.prompt_index, len(rnd.idx), n)
            if fg.metric == "acc":
                values = torch.tensor(self.positive(step, r, rnd), dtype=torch.float32)  # [N]
            else:
                values = rnd.batch.rewards  # [N]
            grouped = values.view(-1, n)  # [B, G]
            return (grouped.amax(1) != grouped.amin(1)).tolist()

        draw = draw_groups(need, fg.max_gen_rounds, run_round)
        mini = cfg.actor.mini_batch_prompts
        chosen = draw.kept[: len(draw.kept) - len(draw.kept) % mini]
        padded = draw.flat[: mini - len(chosen)] if not chosen else []
        metrics = {
            **self._random_metrics(step, rounds),
            "filter/rounds": draw.rounds,
            "filter/prompts_drawn": draw.drawn,
            "filter/kept_frac": draw.informative / draw.drawn,
            "filter/groups_trained": len(chosen + padded),
            "filter/short_groups": need - len(chosen),
            "filter/padded_groups": len(padded),
        }
        if len(chosen) < need:
            print(
                f"[bandpo] step {step}: dynamic sampling found {draw.informative} varying groups of {need} "
                f"in {draw.rounds} rounds (algorithm.filter_groups.max_gen_rounds={fg.max_gen_rounds}); "
                f"training on {len(chosen)} (+{len(padded)} equal-metric)",
                file=sys.stderr,
                flush=True,
            )
        return Drawn(
            Round.gather(rounds, chosen + padded, n),
            metrics,
            [s for r in rounds for s in r.scores],
            sum(int(r.batch.response_lengths.sum()) for r in rounds),
        )
