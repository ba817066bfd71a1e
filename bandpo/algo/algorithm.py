"""One algorithm's entry in the registry (``bandpo.algo.registry``): its surrogate, the options it
reads with its paper's defaults, and the metrics it adds.

Each entry is defined beside its surrogate or bounds (``bandpo.algo.clipped``: grpo, clip_higher,
bandpo; ``bandpo.algo.dcpo``; ``bandpo.algo.rivals``) and listed in that module's ``ENTRIES``, so that
adding an algorithm touches its own module, not the loss or the config's validation; its recipe
(``configs/algorithm/<name>.yaml``) and the name lists kept by hand in the docs follow
(``tests/unit/algo/test_registry.py`` checks them against the registry).

The surrogate's contract, called by ``bandpo.algo.losses.policy_loss`` as
``algo.surrogate(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy)``:
the tensors are [N, R] (``advantages`` already broadcast, ``maskf`` the valid tokens as floats,
``old_entropy`` None unless the caller has it), ``options`` the run's ``LossOptions``; it returns a
``PerToken``. The loss aggregates, weights and regularises ``PerToken.loss`` the same way for every
algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# The options that only some algorithms read (``LossOptions`` fields and ``algorithm.*`` config keys):
# set for an algorithm whose entry does not read it, such an option is refused by name, never ignored.
SCOPED_OPTIONS = (
    "eps_low",
    "eps_high",
    "dual_clip",
    "upper_cap",
    "relax_high_p",
    "band_adaptive",
    "ratio_cap",
    "tau_pos",
    "tau_neg",
    "cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_coef",
)


class PerToken(NamedTuple):
    """What a surrogate gives ``policy_loss`` for one micro-batch.

    Attributes:
        loss: L [N, R], the per-token loss before masking and aggregation.
        up, down: boolean [N, R], the tokens whose update the surrogate cut above / below (the clip
            fractions; disjoint).
        ratio, log_ratio: r and log r [N, R] (log-ratio clamped to [-20, 20]), with or without grad:
            only their values are read, for ``approx_kl``.
        metrics: the algorithm's own metrics (detached 0-dim tensors), empty for most.
    """

    loss: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    metrics: dict[str, torch.Tensor]


# eq=False: entries are compared (and hashed) by identity, since their dict fields are unhashable.
@dataclass(frozen=True, eq=False)
class Algorithm:
    """An algorithm: its surrogate, the options it reads, its paper's defaults, its metrics.

    Attributes:
        name: the ``algorithm`` option's value (``algorithm=<name>`` in the config).
        surrogate: the per-token loss (module docstring).
        reads: the ``SCOPED_OPTIONS`` it reads; the others are refused when set.
        defaults: the value of an option it reads when the run leaves it None, from its paper's recipe:
            ``eps_low``/``eps_high`` (what they bound is the surrogate's: the ratio, DCPO's |r - 1| r q,
            DPPO's divergence, GSPO's sequence ratio, CISPO's weight), SAPO's temperatures and the
            covariance methods' options (``bandpo.algo.cov``).
        bounds: the clipped family's ratio interval ``bounds(old_logprobs, eps_low, eps_high, *,
            divergence, delta, upper_cap, relax_high_p, delta_t, delta_range) -> (lo, hi)``, floats or
            tensors shaped like ``old_logprobs`` (the keywords of ``bandpo.algo.losses.ratio_interval``;
            each reads those it needs); None for a surrogate of its own.
        metric_prefix: the prefix of the metrics of its per-token bounds (``<prefix>/lower_mean``,
            ``<prefix>/log_upper_mean``, and ``<prefix>/delta_mean`` with a per-token band radius);
            None: no such metrics.
        band: it reads the Band's options (divergence, delta, relax_high_p, band_adaptive; the
            ``algorithm.band`` block of the config).
        agg: ``(mode, why)``: the only loss aggregation its objective allows; None: any.
        config_keys: for an option it reads from another config key than ``algorithm.<option>``, that key
            (named when another algorithm refuses the option, and when the top-level key is set for this one).
        why_not: its own reason for not reading an option, shown when the option is refused for it
            (otherwise the refusal names the algorithms that read it).
    """

    name: str
    surrogate: Callable[..., PerToken]
    reads: frozenset[str]
    defaults: Mapping[str, float] = field(default_factory=dict)
    bounds: Callable | None = None
    metric_prefix: str | None = None
    band: bool = False
    agg: tuple[str, str] | None = None
    config_keys: Mapping[str, str] = field(default_factory=dict)
    why_not: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.reads) - set(SCOPED_OPTIONS)
        if unknown:
            raise ValueError(f"algorithm {self.name!r} reads unknown options {sorted(unknown)}")
        unread = set(self.defaults) - set(self.reads)
        if unread:
            raise ValueError(
                f"algorithm {self.name!r} has defaults for options it does not read: {sorted(unread)}"
            )

    def resolve(self, option: str, value):
        """``value`` (the run's setting of ``option``), or this algorithm's default when it is None."""
        return self.defaults.get(option) if value is None else value
