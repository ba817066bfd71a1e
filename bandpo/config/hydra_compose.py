"""Compose the Hydra training config from ``configs/`` and the command line's overrides over the schema
(``bandpo.config.schema``), refusing an override of a key the config does not have (naming the closest
one) or a value of the wrong type (naming the key), turn it into the schema's dataclasses, then
validate it (``bandpo.config.rules``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from pathlib import Path

from bandpo.config.schema import TrainConfig
from bandpo.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


SCHEMA_NAME = "train_schema"  # configs/train.yaml's first default: the typed base every group merges into


def compose(overrides: Sequence[str] = (), config_name: str = "train") -> TrainConfig:
    """The composed config for ``overrides`` (as on the command line) as the schema's dataclasses, validated."""
    from hydra.errors import HydraException

    def schema(groups):
        return _hydra_config(config_name, tuple(groups))

    overrides = [_add_to_free_map(o) for o in overrides]
    try:
        # Hydra itself refuses an unknown `k=v` (checked below only to name the closest key)
        # but adds `+k=v` / `++k=v`: those are checked first.
        if any(o.lstrip().startswith(("+", "~")) for o in overrides):
            check_override_keys(overrides, schema)
        try:
            cfg = _hydra_config(config_name, tuple(overrides))
        except Exception:  # an override below a null section fails inside OmegaConf: name the key
            check_override_keys(overrides, schema)
            raise
    except HydraException as e:
        hint = ""
        if "'algorithm.band." in str(e):  # an algorithm without a band has no band section to override
            hint = _band_hint()
        # a value the schema's type refuses: Hydra's line naming the override, then OmegaConf's reason
        why = str(getattr(e.__cause__, "msg", "") or "").split("\n")[0]
        message = f"{str(e).splitlines()[0]}: {why}" if why else str(e)
        raise ConfigError(f"config error: {message}{hint}") from None
    from bandpo.config.rules import validate

    typed = to_typed(cfg)
    validate(typed)
    return typed


def _hydra_config(config_name: str, overrides: tuple[str, ...]):
    """Hydra's composition of ``overrides`` (``hydra.compose``), read-only.

    A program composes once; the test suite ~400 times, ~330 of them distinct, at ~0.2 s of Hydra and
    OmegaConf each, nearly all of it building the defaults tree and merging its files. So the work is
    split as Hydra splits it: the group choices (``model=tiny``) pick and merge the files, composed
    once per process for each distinct set of choices (``_groups_config``); the value overrides
    (``actor.lr=1e-6``, ``+k=v``, ``~k``) are then applied to a copy of that by Hydra's own step for
    them, in their order, with Hydra's errors (``ConfigLoaderImpl._apply_overrides_to_config``, the
    step ``hydra.compose`` runs after merging). The files under ``configs/`` do not change while a
    process runs; interpolations (``${oc.env:...}``) stay unresolved here and are resolved by
    ``to_typed`` on every call. An override this split is not sure of (a ``hydra`` key, a package
    ``@``, adding or deleting a group) takes Hydra's whole path. tests/unit/config/test_compose_split.py
    checks both paths give the same config or the same error."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    groups, values = [], []
    for o in parsed:
        key = o.key_or_group
        if o.is_hydra_override() or key.startswith("hydra") or "@" in key or o.package is not None:
            return _full_config(config_name, overrides)
        if (CONFIG_DIR / key).is_dir():
            if not (o.type.name == "CHANGE" and "/" not in key):
                return _full_config(config_name, overrides)
            groups.append(o.input_line)
        else:
            values.append(o)
    cfg = copy.deepcopy(_groups_config(config_name, tuple(groups)))
    OmegaConf.set_readonly(cfg, None)  # the copy is this call's own
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


@functools.lru_cache(maxsize=256)
def _groups_config(config_name: str, groups: tuple[str, ...]):
    """Hydra's whole composition of the group choices ``groups`` alone, once per process (read-only:
    callers copy it). A composition that fails raises and is not cached."""
    return _full_config(config_name, groups)


def _full_config(config_name: str, overrides: Sequence[str]):
    """``hydra.compose`` of ``overrides``, read-only."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    _store_schema()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = hydra_compose(config_name, overrides=list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg


@functools.cache
def _store_schema() -> None:
    """Put the schema in Hydra's config store, once per process: storing converts the dataclasses to a
    structured config (~0.1 s, a quarter of a compose), and the store hands every compose a deep copy."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def to_typed(cfg) -> TrainConfig:
    """The composed DictConfig as ``TrainConfig`` (interpolations resolved); a ``???`` left, a broken
    interpolation or a value of the wrong type is a ``ConfigError`` naming the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        key = e.full_key
        raise ConfigError(f"config error: {key} is required (it is ???); set it with {key}=...") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config error: {e.full_key}: {e.msg}") from None


@functools.cache
def free_maps() -> dict[str, str | None]:
    """The schema's mappings whose keys the user names (``eval.paths``, ``probe.paths``, ``model.build_args``:
    its ``dict``-typed fields), each with the interpolation it follows by default (``probe.paths``:
    ``${eval.paths}``) or None."""
    import dataclasses
    import typing

    def walk(cls, prefix: str):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, path = hints[f.name], prefix + f.name
            if typing.get_origin(tp) is dict:
                follows = f.default if isinstance(f.default, str) and f.default.startswith("${") else None
                yield path, follows
            inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
            if dataclasses.is_dataclass(inner[0]):
                yield from walk(inner[0], path + ".")

    return dict(walk(TrainConfig, ""))


def _in_free_map(key: str) -> bool:
    return any(key.startswith(m + ".") for m in free_maps())


def _add_to_free_map(override: str) -> str:
    """``eval.paths.amc23=<file>`` as ``++eval.paths.amc23=<file>`` (and ``eval.paths={...}`` as
    ``++eval.paths={...}``): a key of a mapping the user names is new to Hydra, which wants ``+`` to add it;
    the docs and error messages give the plain form (as ``bandpo.eval``'s command line takes it), so the
    trainer takes both (``++``: add, or set if present). A key inside a mapping that follows another
    (``probe.paths.<name>``) is refused: OmegaConf would write it into the one it follows."""
    if "=" not in override:
        return override
    key = override.split("=", 1)[0].strip()
    bare = key.lstrip("+~")
    for m, follows in free_maps().items():
        if follows and bare.startswith(m + "."):
            source = follows[2:-1]
            raise ConfigError(
                f"config error: {bare}: {m} follows {source} (a key set inside it would be set in {source}); "
                f"give {source}.<name>=<file> for both, or {m}={{<name>: <file>}} for {m} alone"
            )
        if (bare == m or bare.startswith(m + ".")) and key == bare:
            return "++" + override.lstrip()
    return override


def check_override_keys(overrides: Sequence[str], compose_groups) -> None:
    """Refuse an override of a key the config does not have, in every form (``k=``, ``+k=``, ``++k=``, ``~k``);
    a key inside one of the ``free_maps`` is the user's to name.

    Hydra adds unknown keys on ``+k=v`` / ``++k=v`` (its append syntax), and a misspelt
    option would then be silently ignored. The schema is the config composed with only the
    group choices among ``overrides`` (``compose_groups(list)``: ``model=...`` changes which
    keys exist); the error names the key and the closest valid one.
    """
    import difflib

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    is_group = [(CONFIG_DIR / o.key_or_group.split("@")[0]).is_dir() for o in parsed]
    schema = compose_groups([o.input_line for o, group in zip(parsed, is_group) if group])
    keys = _dotted_keys(OmegaConf.to_container(schema, resolve=False))
    for o, group in zip(parsed, is_group):
        key = o.key_or_group
        if group or key.startswith("hydra.") or key in keys or _in_free_map(key):
            continue
        close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        # no band block
        if key.startswith("algorithm.band.") and not any(k.startswith("algorithm.band.") for k in keys):
            hint = _band_hint()
        raise ConfigError(f"config error: {key} is not a config key (override {o.input_line!r}){hint}")


def _band_hint() -> str:
    from bandpo.config.algorithm import band_algorithms

    return f" (algorithm.band.* options apply to algorithm={band_algorithms()} only)"


def _dotted_keys(node, prefix: str = "") -> set[str]:
    """Every key of a plain container as a dotted path, inner nodes and list indices included."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out: set[str] = set()
    for k, v in items:
        path = f"{prefix}{k}"
        out.add(path)
        out |= _dotted_keys(v, path + ".")
    return out


def to_plain(node):
    """A config section (a schema dataclass or an OmegaConf node) as plain Python containers
    (interpolations resolved); other values unchanged."""
    import dataclasses

    from omegaconf import OmegaConf

    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
