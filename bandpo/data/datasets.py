"""Math problem sets as ``Example`` records (``bandpo.types``): from Hugging Face hub ids or local JSONL/JSON/parquet files.

Every source ends up as ``list[Example]`` (id, problem, answer, source). Rows whose problem
or answer is missing or empty are skipped; the count and the first few ids are logged.

Named sets (``REGISTRY``) carry their hub id, split and field mapping; synthetic sets
(``GENERATED``, e.g. ``tiny_arith``) are built in-process. ``load_examples`` also takes a
local file path, or any other hub id with explicit ``problem_key``/``answer_key``. Keys may
be dotted paths into nested rows (``reward_model.ground_truth``, ``prompt.0.content``); rows
become examples in ``bandpo.data.rows``.

Input that cannot be read (a missing file, a broken line, an unknown name or key, a hub set that
is neither reachable nor cached) raises ``InputError`` naming the file, row or hub id; the
config-level loaders (``load_source`` callers, ``load_eval_sets``) add the config key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bandpo.data.rows import examples_from_rows, read_rows
from bandpo.errors import InputError
from bandpo.types import Example

log = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named set lives on the hub and how its rows map to ``Example`` fields."""

    hub_id: str
    split: str
    problem_key: str = "problem"
    answer_key: str = "answer"
    id_key: str | None = "id"
    config: str | None = None  # the hub "subset" (load_dataset's second argument)
    levels: tuple[int, ...] | None = None  # MATH difficulty levels to keep (others are filtered out)
    level_key: str = "level"
    dedup: bool = False  # drop repeated problem texts (keep the first)


REGISTRY: dict[str, DatasetSpec] = {
    # Training sets.
    # The raw DAPO set repeats each of its ~17.4k prompts about 100 times, hence dedup.
    "dapo17k": DatasetSpec(
        "BytedTsinghua-SIA/DAPO-Math-17k",
        "train",
        problem_key="prompt",
        answer_key="reward_model.ground_truth",
        id_key="extra_info.index",
        dedup=True,
    ),
    # The paper's training set: DAPO deduplicated (~17.4k prompts, config "all"; "en" drops Chinese prompts).
    "dapo17k_processed": DatasetSpec(
        "open-r1/DAPO-Math-17k-Processed",
        "train",
        config="all",
        problem_key="prompt",
        answer_key="solution",
        id_key="extra_info.index",
    ),
    # Listed before math_l3to5 so that the bare hub id resolves to the whole train split.
    "math_train": DatasetSpec("nlile/hendrycks-MATH-benchmark", "train", id_key="unique_id"),
    "math_l3to5": DatasetSpec(
        "nlile/hendrycks-MATH-benchmark",
        "train",
        id_key="unique_id",
        levels=(3, 4, 5),
    ),
    # Evaluation sets.
    "math500": DatasetSpec("nlile/hendrycks-MATH-benchmark", "test", id_key="unique_id"),
    "amc23": DatasetSpec("math-ai/amc23", "test", problem_key="question"),
    "aime24": DatasetSpec("HuggingFaceH4/aime_2024", "train"),
    "aime24_mathai": DatasetSpec("math-ai/aime24", "test", answer_key="solution"),  # solution is "\boxed{N}"
    "aime25": DatasetSpec("math-ai/aime25", "test"),
    "aime25_yentinglin": DatasetSpec("yentinglin/aime_2025", "train"),
}


@dataclass(frozen=True)
class GeneratedSpec:
    """A synthetic set built in-process: ``make(split, size, seed, **options)`` returns rows with
    id/problem/answer; ``options`` names the keyword options ``make`` takes (a data source may set them)."""

    make: Callable[..., list[dict]]
    split: str
    size: int
    seed: int = 0
    options: tuple[str, ...] = ()


def _tiny_arith(split: str, size: int, seed: int, **options: Any) -> list[dict]:
    from bandpo.data.tiny_arith_problems import make_split

    try:
        return make_split(split, size, seed, **options)
    except ValueError as e:  # a difficulty or kinds outside the generator's, or too few problems
        raise InputError(f"tiny_arith[{split}:{size}:{seed}] {options}: {e}") from None


_TINY_ARITH_OPTIONS = ("kinds", "difficulty", "part")  # make_split's keyword options
GENERATED: dict[str, GeneratedSpec] = {
    "tiny_arith": GeneratedSpec(_tiny_arith, "train", 2048, options=_TINY_ARITH_OPTIONS),
    # 200 held-out problems: the same set as the warm-start check of bandpo.models.tiny_arith.
    "tiny_arith_test": GeneratedSpec(_tiny_arith, "test", 200, options=_TINY_ARITH_OPTIONS),
}


def dataset_names() -> list[str]:
    """The registered names (hub-backed and generated), sorted."""
    return sorted([*REGISTRY, *GENERATED])


def is_local_path(name_or_path: str) -> bool:
    """True when the string names a local file (by existence or by a data-file suffix)."""
    return Path(name_or_path).suffix.lower() in LOCAL_SUFFIXES or Path(name_or_path).is_file()


def load_examples(
    name_or_path: str,
    *,
    problem_key: str | None = None,
    answer_key: str | None = None,
    id_key: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    size: int | None = None,
    seed: int | None = None,
    cache_dir: str | None = None,
    **options: Any,
) -> list[Example]:
    """Load a problem set by registered name, generated-set name, hub id or local file path.

    Resolution order: an existing local file (or a name ending in .jsonl/.json/.parquet);
    a generated set (``GENERATED``: ``split``, ``size`` and ``seed`` choose what is built);
    a registered name; a registered hub id; any other hub id ("owner/name"), read with
    the given keys (default "problem"/"answer") and split (default "train").
    Keyword arguments override the registered field mapping and split. ``limit`` keeps
    the first ``limit`` examples after skipping bad rows. ``options`` go to a generated set's
    generator (``GeneratedSpec.options``: tiny_arith's ``kinds``, ``difficulty`` and ``part``).
    Raises ``InputError`` for an unknown name (listing the valid ones), for ``size``/``seed``/
    ``options`` given to a set that does not take them, for a missing or malformed local file, and
    (``HubUnreachable``) for a hub set that is neither reachable nor in the local cache.
    """
    keys = {"problem_key": problem_key, "answer_key": answer_key, "id_key": id_key}
    overrides = {k: v for k, v in keys.items() if v is not None}
    options = {k: v for k, v in options.items() if v is not None}
    if (size is not None or seed is not None or options) and name_or_path not in GENERATED:
        raise InputError(
            f"dataset {name_or_path!r}: size/seed/{'/'.join(OPTION_KEYS)} apply only to generated sets "
            f"({', '.join(GENERATED)})"
        )
    if is_local_path(name_or_path):
        examples = load_local(name_or_path, **overrides)
    elif name_or_path in GENERATED:
        gen = GENERATED[name_or_path]
        split = split or gen.split
        size = gen.size if size is None else size
        seed = gen.seed if seed is None else seed
        unknown = sorted(set(options) - set(gen.options))
        if unknown:
            raise InputError(
                f"dataset {name_or_path!r}: it takes no {unknown}; its options: {list(gen.options)}"
            )
        rows = gen.make(split, size, seed, **options)
        where = f"{name_or_path}[{split}:{size}:{seed}{''.join(f':{k}={v}' for k, v in options.items())}]"
        examples = examples_from_rows(rows, source=name_or_path, where=where, **overrides)
    else:
        spec = _resolve_spec(name_or_path)
        if split is not None or overrides:
            spec = DatasetSpec(**{**spec.__dict__, **overrides, **({"split": split} if split else {})})
        examples = load_hub(spec, source=name_or_path, cache_dir=cache_dir)
    return examples[:limit] if limit is not None else examples


def load_many(sources: Sequence[str | Mapping[str, Any]], **defaults: Any) -> list[Example]:
    """Concatenate several sources in order, each as in ``load_source`` (e.g. a data config's ``train``
    list: the paper's DAPO-17k + MATH levels 3-5)."""
    out: list[Example] = []
    for source in sources:
        out.extend(load_source(source, **defaults))
    return out


# Every generated set's generator options (GeneratedSpec.options), as a data source may give them.
OPTION_KEYS = tuple(dict.fromkeys(key for gen in GENERATED.values() for key in gen.options))
SOURCE_KEYS = (
    "name",
    "path",
    "problem_key",
    "answer_key",
    "id_key",
    "split",
    "limit",
    "size",
    "seed",
    *OPTION_KEYS,
)


def load_source(entry: str | Mapping[str, Any], **defaults: Any) -> list[Example]:
    """Load one entry of a data config's source list.

    ``entry`` is a name / hub id / path string, or a mapping with ``name`` and/or ``path`` plus
    any of ``problem_key``, ``answer_key``, ``id_key``, ``split``, ``limit``, ``size``, ``seed``, and a
    generated set's options (``kinds``, ``difficulty``, ``part``)
    (e.g. ``{name: tiny_arith, split: train, size: 4096}``, ``{name: tiny_arith, kinds: [add, sub, mul],
    difficulty: 2}``, ``{path: /d/train.jsonl, problem_key: q}``).
    ``name`` and ``path`` together read a local copy of a hub set (``{name: dapo17k, path:
    /d/dapo.jsonl}``, e.g. saved with ``Dataset.to_json`` where the Hub is reachable): with a
    registered name's field mapping, level filter and dedup, so it gives what the hub would
    (an unregistered hub id: the entry's keys, default problem/answer).
    ``defaults`` fill keys the entry does not set. Unknown keys raise ``InputError`` naming them.
    """
    if isinstance(entry, str):
        return load_examples(entry, **defaults)
    entry = {k: v for k, v in dict(entry).items() if v is not None}
    unknown = sorted(set(entry) - set(SOURCE_KEYS))
    if unknown:
        raise InputError(f"data source {entry}: unknown key(s) {unknown}; valid keys: {list(SOURCE_KEYS)}")
    if "name" not in entry and "path" not in entry:
        raise InputError(f"data source {entry}: give 'name', 'path' or both (a local copy of a hub set)")
    if "name" in entry and "path" in entry:
        return _load_local_copy(str(entry.pop("name")), str(entry.pop("path")), {**defaults, **entry})
    target = str(entry.pop("name", None) or entry.pop("path"))
    return load_examples(target, **{**defaults, **entry})


def _load_local_copy(name: str, path: str, options: dict[str, Any]) -> list[Example]:
    """``path`` read as the hub set ``name`` (a registered name's mapping; ``options`` override the keys)."""
    if name in GENERATED:
        raise InputError(
            f"data source {{name: {name}, path: {path}}}: {name} is generated, not read from a file"
        )
    misplaced = sorted(set(options) & {"split", "size", "seed", *OPTION_KEYS})
    if misplaced:
        raise InputError(
            f"data source {{name: {name}, path: {path}}}: {misplaced} do not apply to a local file"
        )
    spec, limit = _resolve_spec(name), options.pop("limit", None)
    mapping = {
        "problem_key": spec.problem_key,
        "answer_key": spec.answer_key,
        "id_key": spec.id_key,
        **options,
    }
    examples = load_local(
        path, **mapping, source=name, levels=spec.levels, level_key=spec.level_key, dedup=spec.dedup
    )
    return examples[:limit] if limit is not None else examples


def load_eval_sets(
    names: Sequence[str] | None,
    paths: str | Sequence[str] | Mapping[str, str] | None = None,
    *,
    key: str = "eval",
    **kwargs: Any,
) -> dict[str, list[Example]]:
    """Evaluation sets by display name.

    ``paths`` selects local copies instead of the hub:
      - a directory: each name in ``names`` is read from ``<dir>/<name>.jsonl`` (or .parquet/.json);
      - a list of files: each file is one set named after its stem (``names`` is then ignored);
      - a mapping name -> file: those names read from their files, the other ``names`` loaded by name
        (mapped names not in ``names`` are evaluated too, after them).
    Without ``paths`` (None or empty) each name is loaded with ``load_examples``.
    An ``InputError`` names the config key (``<key>.datasets`` or ``<key>.paths...``: ``names`` and
    ``paths`` are the eval config's ``datasets`` and ``paths``); a hub set that cannot be loaded
    also names ``<key>.paths.<name>=<file.jsonl>``, the local copy to give instead.
    """
    if not paths:
        if not names:
            raise InputError(f"{key}.datasets: give dataset names or {key}.paths")
        return {display_name(n): _eval_set(n, n, f"{key}.datasets", key, kwargs) for n in names}
    if isinstance(paths, Mapping):
        order = list(names or []) + [str(k) for k in paths if str(k) not in (names or [])]
        return {
            n: _eval_set(n, str(paths[n]), f"{key}.paths.{n}", key, kwargs)
            if n in paths
            else _eval_set(n, n, f"{key}.datasets", key, kwargs)
            for n in order
        }
    if isinstance(paths, str) and Path(paths).is_dir():
        if not names:
            raise InputError(
                f"{key}.paths={paths!r} is a directory; also give the dataset names ({key}.datasets)"
            )
        return {
            n: _eval_set(n, lambda n=n: str(_find_in_dir(Path(paths), n)), f"{key}.paths", key, kwargs)
            for n in names
        }
    files = [paths] if isinstance(paths, str) else list(paths)
    return {Path(f).stem: _eval_set(Path(f).stem, str(f), f"{key}.paths", key, kwargs) for f in files}


def _eval_set(
    name: str, target: str | Callable[[], str], where: str, key: str, kwargs: dict
) -> list[Example]:
    """One eval set, its ``InputError`` prefixed with the config key ``where`` (``target``: a name or file, or
    a function finding the file)."""
    from bandpo.hub import keyed

    try:
        return load_examples(target if isinstance(target, str) else target(), **kwargs)
    except InputError as e:
        raise keyed(e, where, f"{key}.paths.{name}=<file.jsonl> (rows with problem and answer)") from e


def load_hub(spec: DatasetSpec, *, source: str | None = None, cache_dir: str | None = None) -> list[Example]:
    """Download (or read from the HF cache) one hub set and map its rows through ``spec``.

    Offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) reads the cache only
    (``bandpo.hub``); a set neither reachable nor cached raises ``HubUnreachable``, any
    other failure of the hub load (unknown repo, split or subset) ``InputError``.
    """
    from datasets import load_dataset  # heavy import, only when the hub is used

    from bandpo.hub import DATASET_OFFLINE_ENV, hub_error

    where = f"{spec.hub_id}[{spec.config or 'default'}:{spec.split}]"
    log.info("loading %s from the hub", where)
    try:
        ds = load_dataset(spec.hub_id, spec.config, split=spec.split, cache_dir=cache_dir)
    # OSError: ConnectionError, DatasetNotFoundError; ValueError: split/subset
    except (OSError, ValueError) as e:
        named = f"{source} " if source and source != spec.hub_id else ""
        subset = f", subset {spec.config}" if spec.config else ""
        raise hub_error(
            f"dataset {named}(hub id {spec.hub_id}{subset}, split {spec.split})", e, DATASET_OFFLINE_ENV
        ) from e
    return examples_from_rows(
        ds,
        problem_key=spec.problem_key,
        answer_key=spec.answer_key,
        id_key=spec.id_key,
        source=source or spec.hub_id,
        where=where,
        levels=spec.levels,
        level_key=spec.level_key,
        dedup=spec.dedup,
    )


def load_local(
    path: str | Path,
    *,
    problem_key: str = "problem",
    answer_key: str = "answer",
    id_key: str | None = "id",
    source: str | None = None,
    levels: Iterable[int] | None = None,
    level_key: str = "level",
    dedup: bool = False,
) -> list[Example]:
    """Read a local .jsonl / .json (a list of rows) / .parquet file into examples."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"dataset file not found: {path}")
    rows = read_rows(path)
    return examples_from_rows(
        rows,
        problem_key=problem_key,
        answer_key=answer_key,
        id_key=id_key,
        source=source or path.stem,
        where=str(path),
        levels=levels,
        level_key=level_key,
        dedup=dedup,
    )


def _resolve_spec(name: str) -> DatasetSpec:
    if name in REGISTRY:
        return REGISTRY[name]
    for spec in REGISTRY.values():
        if spec.hub_id == name:
            return spec
    if "/" in name:  # an unregistered hub id: default mapping, overridable by the caller
        return DatasetSpec(name, "train")
    raise InputError(
        f"unknown dataset {name!r}: not a local file (.jsonl/.json/.parquet), a hub id (owner/name) "
        f"or a registered name; registered names: {', '.join(dataset_names())}"
    )


def display_name(name: str) -> str:
    """Short name for reports: a hub id's registered name, or a file's stem."""
    if is_local_path(name):
        return Path(name).stem
    for key, spec in REGISTRY.items():
        if spec.hub_id == name:
            return key
    return name


def _find_in_dir(directory: Path, name: str) -> Path:
    for suffix in LOCAL_SUFFIXES:
        candidate = directory / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    present = sorted(p.name for p in directory.iterdir() if p.suffix.lower() in LOCAL_SUFFIXES)
    raise InputError(f"no {name}.jsonl/.json/.parquet in {directory}; files there: {present}")
