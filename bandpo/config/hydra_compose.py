"""Compose the Hydra training config from ``configs/`` and the command line's overrides, refusing an
override of a key the config does not have (naming the closest one), then validate it
(``bandpo.config.rules``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bandpo.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose(overrides: Sequence[str] = (), config_name: str = "train"):
    """The composed config for ``overrides`` (as on the command line), validated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):

            def schema(groups):
                return hydra_compose(config_name, overrides=groups)

            # Hydra itself refuses an unknown `k=v` (checked below only to name the closest key)
            # but adds `+k=v` / `++k=v`: those are checked first.
            if any(o.lstrip().startswith(("+", "~")) for o in overrides):
                check_override_keys(overrides, schema)
            try:
                cfg = hydra_compose(config_name, overrides=list(overrides))
            except HydraException:
                check_override_keys(overrides, schema)
                raise
    except HydraException as e:
        hint = ""
        if "'algorithm.band." in str(e):  # grpo / clip_higher have no band block to override
            hint = " (algorithm.band.* options apply to algorithm=bandpo only)"
        raise ConfigError(f"config error: {e}{hint}") from None
    from bandpo.config.rules import validate

    validate(cfg)
    return cfg


def check_override_keys(overrides: Sequence[str], compose_groups) -> None:
    """Refuse an override of a key the config does not have, in every form (``k=``, ``+k=``, ``++k=``, ``~k``).

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
        if group or key.startswith("hydra.") or key in keys:
            continue
        close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        # no band block
        if key.startswith("algorithm.band.") and not any(k.startswith("algorithm.band.") for k in keys):
            hint = " (algorithm.band.* options apply to algorithm=bandpo only)"
        raise ConfigError(f"config error: {key} is not a config key (override {o.input_line!r}){hint}")


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
    """An OmegaConf node as plain Python containers (interpolations resolved); other values unchanged."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
