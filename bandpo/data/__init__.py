"""Problem sets (hub ids or local files), prompt templates and the resumable index sampler.

``Example`` is defined with the other records in ``bandpo.types`` (so importing this package
imports torch); the ``datasets`` library and ``transformers`` load only when used.
"""

from bandpo.data.datasets import (
    GENERATED,
    REGISTRY,
    DatasetSpec,
    dataset_names,
    load_eval_sets,
    load_examples,
    load_local,
    load_many,
    load_source,
)
from bandpo.data.prompts import (
    TEMPLATES,
    EncodedPrompts,
    answer_format_for,
    encode_examples,
    format_user_message,
    render_prompt,
)
from bandpo.data.sampler import EpochSampler
from bandpo.types import Example

__all__ = [
    "GENERATED",
    "REGISTRY",
    "TEMPLATES",
    "DatasetSpec",
    "EncodedPrompts",
    "EpochSampler",
    "Example",
    "answer_format_for",
    "dataset_names",
    "encode_examples",
    "format_user_message",
    "load_eval_sets",
    "load_examples",
    "load_local",
    "load_many",
    "load_source",
    "render_prompt",
]
