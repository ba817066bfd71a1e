"""Rules on single values that the config validation shares with the mechanisms they protect.

Each ``check_*`` raises ``ValueError`` (or ``ConfigError``) naming the value as its caller calls it:
the config's key in validation (``bandpo.config.rules``), the argument's name where the trainer, the
actor or the evaluation check it again. They sit here, beside the schema, so that the config imports
nothing above it: the trainer, the actor and the evaluation import them from here.
"""

from __future__ import annotations

from bandpo.errors import ConfigError, check_number

# Overlap (bandpo.trainer.overlap): trainer.max_staleness's values.
MAX_STALENESS = (0, 1)
# w = min(pi_old / pi_rollout, C) under staleness when algorithm.tis_cap is null: C = 2 is the
# cap verl recommends for its rollout/training mismatch correction (``tis_imp_ratio_cap``).
STALE_TIS_CAP = 2.0


def check_layout(max_staleness: int, layout: str) -> None:
    """Refuse overlap where the engines and the actor share the devices in time (``colocated``)."""
    if max_staleness > 0 and layout == "colocated":
        raise ConfigError(
            f"config error: trainer.max_staleness={max_staleness} needs the engines and the actor on separate "
            f"GPUs: the colocated layout time-shares them (the engines sleep during the update). Set actor.gpus "
            f"and rollout.gpus (split layout) or trainer.max_staleness=0"
        )


def check_max_gen_rounds(max_rounds, name: str = "max_gen_rounds") -> None:
    """Dynamic sampling's bound on generation rounds a step: an integer >= 1 (1 = no extra round)."""
    check_number(max_rounds, name, low=1, integer=True)


def check_sync_check_tol(value, staleness: int, top_p: float, top_k: int) -> None:
    """``rollout.sync_check_tol``: auto, off or a number > 0; a number where the stale-weights check
    cannot hold (``bandpo.trainer.sync_check``) is a ValueError naming both keys."""
    key = "rollout.sync_check_tol"
    if value in ("auto", "off"):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key} must be auto, off or a number > 0, got {value!r}")
    if staleness:
        raise ValueError(
            f"{key}={value} cannot be used with trainer.max_staleness={staleness} (batches come from "
            "weights one update older by design); use auto or off"
        )
    if top_p < 1 or top_k > 0:
        raise ValueError(
            f"{key}={value} cannot be used with rollout.top_p={top_p} / rollout.top_k={top_k} (the "
            "engines' log-probs are renormalised over the kept tokens); use auto or off"
        )


def check_samples(n, name: str = "eval.n") -> None:
    """Samples per problem (``eval.n``; mean@n, pass@k and maj@n are over them): an integer >= 1."""
    check_number(n, name, low=1, integer=True)


# actor.logprob_head's values: auto and the heads of bandpo.actor.chunked.HEADS (which checks it is so)
HEAD_CHOICES = ("auto", "online", "chunked")


def check_chunk(chunk, name: str = "chunk") -> None:
    """Tokens per lm_head chunk (``actor.logits_chunk_tokens``): an integer >= 1."""
    check_number(chunk, name, low=1, integer=True)


def check_temperature(temperature, name: str = "temperature") -> None:
    """The sampling temperature the logits are divided by (the actor's, ``rollout.temperature``): a finite number > 0."""
    check_number(temperature, name, low=0, strict_low=True)


def check_batch_split(
    mini_batch_size,
    micro_batch_size,
    world_size,
    names: tuple[str, str, str] = ("mini_batch_size", "micro_batch_size", "world_size"),
) -> None:
    """An optimizer step's rows split evenly: ``world_size`` ranks share the ``mini_batch_size`` rows, and each
    rank's share goes in micro-batches of ``micro_batch_size`` rows; all three are integers >= 1 (``names``:
    how the message calls them, the config's keys in config validation)."""
    for value, name in zip((mini_batch_size, micro_batch_size, world_size), names):
        check_number(value, name, low=1, integer=True)
    if mini_batch_size % world_size:
        raise ValueError(f"{names[2]} must divide {names[0]} ({mini_batch_size} rows), got {world_size}")
    per_rank = mini_batch_size // world_size
    if per_rank % micro_batch_size:
        raise ValueError(
            f"{names[1]} must divide the rows per rank ({names[0]} / {names[2]} = {per_rank}), "
            f"got {micro_batch_size}"
        )


def check_token_budget(budget, name: str = "token budget") -> None:
    """A forward pass's token budget (``packed_budget_groups``, ``bandpo.actor.logprobs.budget_chunks``;
    ``actor.logprob_token_budget``) is an integer >= 1: a row over it still gets a pass of its own."""
    check_number(budget, name, low=1, integer=True)


def check_micro_batch_tokens(
    max_tokens, padding_free, names: tuple[str, str] = ("max_tokens_per_micro_batch", "padding_free")
) -> None:
    """``max_tokens_per_micro_batch``: packed tokens per update micro-batch, an integer >= 0 (0: micro-batches
    of ``micro_batch_size`` rows instead); a budget needs the packed rows of ``padding_free``."""
    check_number(max_tokens, names[0], low=0, integer=True)
    if max_tokens and not padding_free:
        raise ValueError(
            f"{names[0]} must be 0 with {names[1]}=false (padded micro-batches go by micro_batch_size "
            f"rows), got {max_tokens!r}"
        )
