"""Prompt templates and prompt encoding.

A template turns a bare problem into the user turn; the model's chat template then wraps
that turn (plain text when the tokenizer has none). Templates:

- ``dapo``: the paper's format (DAPO-Math-17k), answer on a final "Answer:" line.
- ``boxed``: the common "put your final answer within \\boxed{}" format.
- any other string containing ``{problem}`` is used as a custom template.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from bandpo.types import Example

log = logging.getLogger(__name__)

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."

# ``{problem}`` is substituted with str.replace, not str.format: problems are full of braces.
TEMPLATES: dict[str, str] = {
    "dapo": DAPO_PREFIX + "{problem}" + DAPO_SUFFIX,
    "boxed": "{problem}" + BOXED_SUFFIX,
}

# The verifier's answer format that goes with each template (custom templates use "auto").
ANSWER_FORMATS: dict[str, str] = {"dapo": "dapo", "boxed": "boxed"}


def answer_format_for(template: str, answer_format: str | None = None) -> str:
    """The reward's ``answer_format``: ``answer_format`` when one is set, else the one matching
    ``template`` ("auto" for a custom template), so that a template swapped alone
    (``data.template=boxed``) is not graded for the other template's answer line."""
    return answer_format if answer_format is not None else ANSWER_FORMATS.get(template, "auto")


def format_user_message(problem: str, template: str) -> str:
    """The user turn for ``problem``: a template name from ``TEMPLATES`` or a string with ``{problem}``."""
    if template in TEMPLATES:
        pattern = TEMPLATES[template]
    elif "{problem}" in template:
        pattern = template
    else:
        raise ValueError(
            f"unknown prompt template {template!r}; "
            f"use one of {sorted(TEMPLATES)} or a string containing '{{problem}}'"
        )
    return pattern.replace("{problem}", problem)


def strip_instruction(text: str) -> str:
    """The bare problem from a text that may already carry a template (e.g. DAPO-Math-17k's prompts)."""
    if text.startswith(DAPO_PREFIX):
        return text.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX)
    return text.removesuffix(BOXED_SUFFIX)


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt_text(
    tokenizer, problem: str, template: str = "dapo", system_prompt: str | None = None
) -> str:
    """The full prompt string: the user turn through the chat template, ending with the assistant header.

    Without a chat template the prompt is the user turn itself (``system_prompt`` and a blank
    line before it, when given).
    """
    user = format_user_message(problem, template)
    if not has_chat_template(tokenizer):
        return f"{system_prompt}\n\n{user}" if system_prompt else user
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": user}
    ]
    # tokenize=False: in transformers 5 tokenize=True returns a BatchEncoding, not a list of ids.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt(
    tokenizer, problem: str, template: str = "dapo", system_prompt: str | None = None
) -> list[int]:
    """Token ids of the prompt for ``problem`` (see ``render_prompt_text``)."""
    text = render_prompt_text(tokenizer, problem, template, system_prompt)
    # A chat template already writes BOS and friends; plain text gets the tokenizer's usual specials.
    add_special = not has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


class EncodedPrompts(NamedTuple):
    """What ``encode_examples`` returns; unpacks as ``(examples, prompt_ids, dropped_ids)``."""

    examples: list[Example]  # the kept examples, in input order
    prompt_ids: list[list[int]]  # prompt token ids, one list per kept example
    dropped_ids: list[str]  # ids of examples whose prompt exceeded max_prompt_len


def encode_examples(
    tokenizer,
    examples: Sequence[Example],
    template: str = "dapo",
    max_prompt_len: int | None = None,
    system_prompt: str | None = None,
) -> EncodedPrompts:
    """Render every example's prompt; drop those longer than ``max_prompt_len`` tokens, logging the count."""
    kept, ids, dropped = [], [], []
    for ex in examples:
        tokens = render_prompt(tokenizer, ex.problem, template, system_prompt)
        if max_prompt_len is not None and len(tokens) > max_prompt_len:
            dropped.append(ex.id)
            continue
        kept.append(ex)
        ids.append(tokens)
    if dropped:
        log.warning(
            "dropped %d of %d prompt(s) longer than max_prompt_len=%d tokens (first ids: %s)",
            len(dropped),
            len(examples),
            max_prompt_len,
            ", ".join(dropped[:5]),
        )
    return EncodedPrompts(kept, ids, dropped)
