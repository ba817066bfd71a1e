"""Every algorithm by name: the entries (``bandpo.algo.algorithm.Algorithm``) of the modules that
define them, and the refusal of an option the chosen algorithm does not read.

The order is the modules' below, each in its own ``ENTRIES`` order: it is the order of every list of
names shown (``algorithm must be one of ...``, the readers of an option in a refusal).
"""

from __future__ import annotations

from bandpo.algo import clipped, cov, dcpo, rivals
from bandpo.algo.algorithm import SCOPED_OPTIONS, Algorithm
from bandpo.errors import check_choice


def _by_name(*entries: Algorithm) -> dict[str, Algorithm]:
    out: dict[str, Algorithm] = {}
    for entry in entries:
        if entry.name in out:
            raise ValueError(f"two algorithms are registered as {entry.name!r}")
        out[entry.name] = entry
    return out


ALGORITHMS: dict[str, Algorithm] = _by_name(*clipped.ENTRIES, *rivals.ENTRIES, *dcpo.ENTRIES, *cov.ENTRIES)

# How a refusal names the readers of an option where "it applies to <readers> only" would not say why.
_READERS_PHRASE = {"dual_clip": "the dual clip is the clipped surrogate's ({})"}


def get_algorithm(name: str) -> Algorithm:
    """The entry named ``name``; a ValueError listing the valid names otherwise."""
    check_choice(name, ALGORITHMS, "algorithm")
    return ALGORITHMS[name]


def readers(option: str) -> list[str]:
    """The names of the algorithms that read ``option`` (one of ``SCOPED_OPTIONS``), in the registry's order."""
    return [name for name, entry in ALGORITHMS.items() if option in entry.reads]


def and_list(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def why_refused(algorithm: str, option: str) -> str:
    """Why ``algorithm`` does not read ``option``: its own reason (``Algorithm.why_not``), else who does."""
    own = get_algorithm(algorithm).why_not.get(option)
    if own is not None:
        return own
    names = [
        f"{name} ({ALGORITHMS[name].config_keys[option]} in the config)"
        if option in ALGORITHMS[name].config_keys
        else name
        for name in readers(option)
    ]
    if option in _READERS_PHRASE:
        return _READERS_PHRASE[option].format(", ".join(names))
    return f"it applies to {and_list(names)} only"


def check_applies(algorithm: str, option: str, name: str | None = None) -> None:
    """Refuse ``option`` (one of ``SCOPED_OPTIONS``, shown as ``name``), set, when ``algorithm`` does not read it."""
    if option not in SCOPED_OPTIONS:
        raise ValueError(f"unknown scoped option {option!r}; valid: {', '.join(SCOPED_OPTIONS)}")
    if option not in get_algorithm(algorithm).reads:
        raise ValueError(
            f"{name or option} does not apply to algorithm={algorithm} ({why_refused(algorithm, option)}); "
            f"set it to None (null in the config) or pick another algorithm"
        )
