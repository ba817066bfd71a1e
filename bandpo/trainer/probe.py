"""The fixed-text entropy probe (``probe.*``): the current policy's teacher-forced entropy on frozen
base-model responses to held-out prompts, measured inside the run.

The rollout entropy (``actor/entropy``, ``entropy/*``) is measured on what the policy writes at that
step, so a change in what it writes (shorter answers, another phrasing) reads as a change of entropy.
The probe holds the text fixed: before the first step the rollout engines, still the base policy, sample
``probe.n`` responses to the first ``probe.limit`` problems of each ``probe.datasets`` set (seeded by
``probe.seed``, at the rollout's temperature, top-p and top-k; prompts rendered as the training
prompts are), and their token ids are written once to ``<output_dir>/probe/texts.jsonl`` (a header line
of the settings that made them, then one line per problem). A resumed run reads them back: by then the
base policy is gone, so a missing file, or one made with other settings, stops it with a ``ConfigError``.
A fresh start reuses a file made with the same settings.

Every ``probe.every`` steps, before the first and at the last, the actor's no-grad log-prob pass with
entropy (``ActorGroup.compute_logprobs``, the one stage 5 runs) covers exactly those sequences, and
``probe_metrics`` reduces it (``probe/*``). In the loop it runs in the actor's phase after the update,
so the probe of step s is the policy after s updates, as the evaluation of step s is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bandpo.checkpoint.atomic import write_text_atomic
from bandpo.errors import ConfigError
from bandpo.types import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig

TEXTS_FILE = Path("probe") / "texts.jsonl"  # under the run folder


def probe_metrics(
    entropy: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, first_n: int
) -> dict[str, float]:
    """The probe's reductions of the per-token ``entropy`` and ``logprobs`` [N, R] over the text tokens
    ``mask`` [N, R] (1 = a response token):

    - ``probe/entropy``: token mean (a text weighs by its length; the texts are fixed, so it cannot move
      by length);
    - ``probe/entropy_seq``: mean over texts (with a token) of each one's mean, every text weighing the same;
    - ``probe/entropy_first_n``: token mean over each text's first ``first_n`` tokens;
    - ``probe/logprob``: token mean of log pi(token): how likely the policy finds the base model's text
      (at step 0 the base's own; its fall is how far the policy moved away from the base on base text);
    - ``probe/texts``, ``probe/tokens``: the counts.
    """
    valid = mask.bool()  # [N, R]
    zero = torch.zeros((), dtype=torch.float64)
    ent = torch.where(valid, entropy.double(), zero)  # [N, R], 0 off the mask
    lp = torch.where(valid, logprobs.double(), zero)  # [N, R]
    lengths = valid.sum(1)  # [N]
    tokens = int(lengths.sum())
    out = {"probe/texts": float(valid.shape[0]), "probe/tokens": float(tokens)}
    if tokens == 0:
        return out
    first = valid & (valid.cumsum(1) <= first_n)  # [N, R]: each text's first first_n tokens
    nonempty = lengths > 0  # [N]
    out["probe/entropy"] = ent.sum().item() / tokens
    out["probe/entropy_seq"] = (ent.sum(1)[nonempty] / lengths[nonempty]).mean().item()
    out["probe/entropy_first_n"] = ent[first].sum().item() / int(first.sum())
    out["probe/logprob"] = lp.sum().item() / tokens
    return out


def probe_settings(cfg: TrainConfig, model_path: str) -> dict[str, Any]:
    """What the texts are a function of: the base model, the sets, the sampling and the prompt rendering."""
    from bandpo.config import to_plain

    p, ro = cfg.probe, cfg.rollout
    return {
        "model": str(model_path),
        "datasets": list(to_plain(p.datasets) or []),
        "paths": dict(to_plain(p.paths) or {}),
        "limit": p.limit,
        "n": p.n,
        "max_tokens": p.max_tokens,
        "seed": p.seed,
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,
        "template": cfg.data.template,
        "max_prompt_len": cfg.data.max_prompt_len,
    }


def load_probe_sets(cfg: TrainConfig) -> dict:
    """The probe's held-out sets (the first ``probe.limit`` problems of each); none when it is off."""
    if not cfg.probe.every:
        return {}
    from bandpo.config import to_plain
    from bandpo.data import load_eval_sets

    paths = to_plain(cfg.probe.paths) or None
    return load_eval_sets(to_plain(cfg.probe.datasets), paths, key="probe", limit=cfg.probe.limit)


def sample_texts(engine, tokenizer, sets: dict, cfg: TrainConfig) -> list[dict]:
    """The base policy's responses, one record per problem: ``set``, ``id``, ``prompt_ids``, ``responses``
    (token ids, EOS included when it ended) and ``finish_reasons``. An empty response (a prompt that
    left no room under ``model.max_model_len``) is left out."""
    from bandpo.data import encode_examples

    names, examples, prompts = [], [], []
    for name, exs in sets.items():
        enc = encode_examples(tokenizer, exs, cfg.data.template, cfg.data.max_prompt_len)
        names += [name] * len(enc.examples)
        examples += enc.examples
        prompts += enc.prompt_ids
    if not prompts:
        raise ConfigError(
            f"config error: probe.datasets={list(sets)}: no problem left after dropping prompts longer "
            f"than data.max_prompt_len={cfg.data.max_prompt_len}"
        )
    p, ro = cfg.probe, cfg.rollout
    sampling = SamplingParams(p.n, ro.temperature, ro.top_p, ro.top_k, p.max_tokens, p.seed)
    batch = engine.generate(prompts, sampling)
    _, responses, _ = batch.to_lists()
    records = [
        {"set": name, "id": ex.id, "prompt_ids": list(ids), "responses": [], "finish_reasons": []}
        for name, ex, ids in zip(names, examples, prompts)
    ]
    for row, i in enumerate(batch.prompt_index.tolist()):
        if responses[row]:
            records[i]["responses"].append(list(responses[row]))
            records[i]["finish_reasons"].append(batch.finish_reasons[row])
    return records


def write_texts(path: Path, settings: dict, records: list[dict]) -> None:
    """The texts file, atomically: the settings' header line, then one line per problem."""
    lines = [json.dumps({"settings": settings})] + [json.dumps(r) for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(line + "\n" for line in lines))


def read_texts(path: Path) -> tuple[dict, list[dict]]:
    """``(settings, records)`` of a texts file ``write_texts`` wrote; a malformed one is an error naming it."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        return lines[0]["settings"], lines[1:]
    except (ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"config error: {path} is not a probe texts file ({e}); remove it") from e


def texts_batch(records: list[dict], pad_id: int, world_size: int) -> tuple[RolloutBatch, int]:
    """The texts as one batch, and its count of real rows: rows are padded with copies of the first to a
    multiple of ``world_size`` (the actor ranks take equal shards); the copies' results are dropped."""
    rows = [
        (r["prompt_ids"], resp, f) for r in records for resp, f in zip(r["responses"], r["finish_reasons"])
    ]
    if not rows:
        raise ValueError("probe: the texts hold no response")
    real = len(rows)
    rows += [rows[0]] * (-real % world_size)
    prompts, responses, finish = (list(col) for col in zip(*rows))
    batch = RolloutBatch.from_lists(
        prompts, responses, [[0.0] * len(r) for r in responses], list(range(len(rows))), finish, pad_id
    )
    return batch, real


class Probe:
    """The probe of one run: ``prepare`` its texts once before the loop, then ``measure`` when ``due``."""

    def __init__(self, cfg: TrainConfig, out: Path, model_path: str, sets: dict, tokenizer):
        self.cfg, self.path, self.sets, self.tokenizer = cfg, Path(out) / TEXTS_FILE, sets, tokenizer
        self.settings = probe_settings(cfg, model_path)
        self.batch: RolloutBatch | None = None
        self.real = 0

    def prepare(self, engine, fresh: bool, world_size: int) -> None:
        """Read the texts back, or on a fresh start (``fresh``: the engines hold the base weights) sample
        and write them when there are none made with these settings."""
        records = None
        if self.path.exists():
            settings, records = read_texts(self.path)
            if settings != self.settings:
                if not fresh:
                    changed = sorted(k for k in self.settings if settings.get(k) != self.settings[k])
                    raise ConfigError(
                        f"config error: {self.path} was made with other settings ({', '.join(changed)}: "
                        f"{[settings.get(k) for k in changed]}, now {[self.settings[k] for k in changed]}); a "
                        "resumed run cannot make new texts (the base policy is gone): restore probe.* or "
                        "turn it off (probe.every=0)"
                    )
                records = None
        elif not fresh:
            raise ConfigError(
                f"config error: probe.every={self.cfg.probe.every} in a resumed run whose start had no "
                f"probe: {self.path} is missing and the base policy that would write it is gone; "
                "start the run afresh (trainer.resume=never) or set probe.every=0"
            )
        if records is None:
            records = sample_texts(engine, self.tokenizer, self.sets, self.cfg)
            write_texts(self.path, self.settings, records)
        pad_id = self.tokenizer.pad_token_id
        pad_id = self.tokenizer.eos_token_id if pad_id is None else pad_id
        self.batch, self.real = texts_batch(records, pad_id, world_size)

    def due(self, step: int) -> bool:
        """The probe runs at step 0, every ``probe.every`` steps and at the last."""
        return step % self.cfg.probe.every == 0 or step == self.cfg.trainer.total_steps

    def measure(self, actor) -> dict[str, float]:
        """The current policy on the texts: the actor's log-prob pass with entropy, reduced."""
        logprobs, entropy = actor.compute_logprobs(self.batch, with_entropy=True)  # [N', R] each
        k = self.real
        return probe_metrics(entropy[:k], logprobs[:k], self.batch.response_mask[:k], self.cfg.probe.first_n)
