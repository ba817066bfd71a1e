"""LoRA adapters on the actor: wrapping the HF model, the reference policy, merged weights for sync.

With ``actor.lora.rank > 0`` the actor's model is wrapped by PEFT (``get_peft_model``) before
``deepspeed.initialize``: every target ``nn.Linear`` gets a frozen ``base_layer`` and two trainable
factors, and only those factors reach the optimizer. The layer computes

    y = x W^T + s * (x A^T) B^T,    s = alpha / rank

Shapes (legend): W [out, in] the base weight, A [rank, in] (``lora_A``), B [out, rank]
(``lora_B``, zero at the start, so the wrapped model starts as the base model exactly).

The factors are in the base model's dtype (bf16 with ``actor.bf16``), under ZeRO-2 and ZeRO-3 alike,
with their fp32 master copy in DeepSpeed's optimizer as for any weight. PEFT's default upcasts them to
fp32 (``autocast_adapter_dtype``); DeepSpeed casts them back under ZeRO-2 (every parameter of a model
not built under ``zero.Init``) but not under ZeRO-3, where each target would keep an fp32 copy of its
input for backward, the adapter files would be fp32 and vLLM would run the adapter in bf16 against an
fp32 actor. So ``apply_lora`` keeps PEFT from upcasting and checks the dtype.

The reference policy is the base model: the same module with the adapters disabled (PEFT's
``disable_adapter``), so no second copy of the weights is loaded for the KL term.

Under ZeRO-3 the base model is built partitioned (``deepspeed.zero.Init``, ``bandpo.actor.loading``)
before PEFT wraps it; PEFT reads a target's sizes from its ``in_features`` / ``out_features``, never
its (partitioned) weight, and makes the factors whole on every rank, which ``deepspeed.initialize``
partitions (rank 0's values broadcast first: every rank starts from the same adapter). Every read of
the full weights then gathers them (the merged sync gathers a target's weight and factors together:
``SyncEntry.params``; the adapter file gathers ``bandpo.lora_weights.lora_factors``) and is collective.
The reference passes skip the adapter modules, so their module order differs from the policy's:
DeepSpeed 0.19's prefetch trace is dropped at the first module that departs from it (the parameters it
prefetched are waited for and released first), the next pass records the new order and the one after
prefetches again; a switch costs the prefetch of two passes, never a value (the policy's log-probs
after a reference pass are the same bits: tests/integration/actor/test_actor_lora.py).

The rollout engines hold the base architecture (no adapters): a sync sends every parameter under its
base name, each target's weight merged, ``W + s * (B @ A)``, computed from the live factors without
writing into the training weights (``bandpo.lora_weights.merged_weight``). PEFT's own
``merge_and_unload`` on a deep copy is the slow, obvious reference (``merged_by_peft``). That is
``rollout.lora_sync=merged``; with ``adapter`` (auto's choice with vLLM) the engines run vLLM's LoRA
and a sync sends the factors alone (``bandpo.actor.lora_files``, ``bandpo.weight_sync.lora_adapter``).

PEFT is imported only here and only when LoRA is on: ``bandpo.algo`` and ``bandpo.reward`` do not
depend on it.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from bandpo.lora_weights import ADAPTER, BASE_LAYER, base_name, is_lora, merged_weight


@dataclass(frozen=True)
class LoraSettings:
    """``actor.lora.*``: rank (0 = off), alpha (the scale is alpha / rank), dropout on the adapter's
    input while training, the names of the ``nn.Linear`` modules that get adapters, and what the final
    HF export writes (``bandpo.checkpoint.lora_adapter.EXPORTS``)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    export: str = "both"

    @classmethod
    def of(cls, value) -> LoraSettings | None:
        """Settings from a ``LoraSettings``, the config's ``actor.lora`` section (``LoraConfig``), a
        mapping of its fields, or None; None when LoRA is off (rank 0)."""
        if value is None:
            return None
        if not isinstance(value, LoraSettings):
            fields = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)
            if "target_modules" in fields:
                fields["target_modules"] = tuple(fields["target_modules"])
            value = cls(**fields)
        return value if value.on else None

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """``model`` wrapped by PEFT with ``settings``' adapters; its own parameters frozen.

    No task type: the plain ``PeftModel`` forwards every keyword to the HF model unchanged (the
    packed attention's layout among them). Raises ValueError naming ``actor.lora.target_modules``
    when a target matches no module, is not a plain ``nn.Linear`` (the merge is ``W [out, in]``'s),
    or is the output embedding (the chunked log-prob head reads its weight, not the adapter). The
    factors take their base layer's dtype (module docstring); a PEFT that casts them otherwise raises.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )
    try:
        # The factors in the base layer's dtype: PEFT's default upcasts bf16 ones to fp32, which
        # DeepSpeed casts back to bf16 under ZeRO-2 but leaves alone under ZeRO-3 (the model, built
        # under zero.Init, is taken to be in its dtype already).
        wrapped = get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as e:
        raise ValueError(f"actor.lora.target_modules={list(settings.target_modules)}: {e}") from e
    for name, mod in wrapped.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        if (
            not isinstance(mod, LoraLinear)
            or type(mod.base_layer) is not torch.nn.Linear
            or mod.fan_in_fan_out
        ):
            raise ValueError(
                f"actor.lora.target_modules: {name} is a {type(mod.base_layer).__name__}; "
                "only nn.Linear layers can take adapters"
            )
        if mod is wrapped.get_output_embeddings():
            raise ValueError(
                f"actor.lora.target_modules: {name} is the output embedding, which cannot take an "
                "adapter (the chunked log-prob head reads its weight directly)"
            )
        for factor in (mod.lora_A[ADAPTER].weight, mod.lora_B[ADAPTER].weight):
            if factor.dtype != mod.base_layer.weight.dtype:
                raise RuntimeError(
                    f"LoRA adapter of {name} is {factor.dtype}, its base layer "
                    f"{mod.base_layer.weight.dtype}: the installed PEFT cast the factors"
                )
    return wrapped


def reference_mode(module: torch.nn.Module, active: bool = True):
    """Context in which ``module`` (a PEFT model or a DeepSpeed engine around one) computes the base
    model: the adapters are skipped, the base weights are the only ones used. A model without
    adapters, or ``active=False``, is left as it is."""
    inner = getattr(module, "module", module)
    return inner.disable_adapter() if active and is_lora(inner) else nullcontext()


@dataclass
class SyncEntry:
    """One tensor a sync sends: its base ``name``, the ``param`` holding it, and for a LoRA target
    its factors (A [rank, in], B [out, rank]) and scale, merged into ``param`` when read."""

    name: str
    param: torch.nn.Parameter
    lora_a: torch.nn.Parameter | None = None
    lora_b: torch.nn.Parameter | None = None
    scaling: float = 1.0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Every parameter the value is computed from (ZeRO-3 gathers them together)."""
        return [p for p in (self.param, self.lora_a, self.lora_b) if p is not None]

    def value(self) -> torch.Tensor:
        """The tensor sent: the parameter itself (detached, no copy), or a new merged one."""
        if self.lora_a is None:
            return self.param.detach()
        with torch.no_grad():
            return merged_weight(
                self.param.detach(), self.lora_a.detach(), self.lora_b.detach(), self.scaling
            )


def sync_entries(module: torch.nn.Module) -> list[SyncEntry]:
    """The base model's parameters of ``module`` in ``named_parameters`` order (tied weights once), with
    each LoRA target's factors attached; a model without adapters gives its parameters as they are."""
    if not is_lora(module):
        return [SyncEntry(name, p) for name, p in module.named_parameters()]
    from peft.tuners.lora import LoraLayer

    factors = {}  # full PEFT name of a base_layer weight -> (A, B, scaling)
    for mod_name, mod in module.named_modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            factors[f"{mod_name}{BASE_LAYER}.weight"] = (
                mod.lora_A[ADAPTER].weight,
                mod.lora_B[ADAPTER].weight,
                mod.scaling[ADAPTER],
            )
    entries = []
    for name, p in module.named_parameters():
        base = base_name(name)
        if base is None:
            continue
        a, b, s = factors.get(name, (None, None, 1.0))
        entries.append(SyncEntry(base, p, a, b, s))
    return entries


def merged_by_peft(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The slow, obvious reference: PEFT's ``merge_and_unload`` on a deep copy of ``module`` (whole
    parameters, no ZeRO-3), as {base name: tensor}. Tied weights once, as ``named_parameters``."""
    merged = copy.deepcopy(module).merge_and_unload()
    return {name: p.detach().clone() for name, p in merged.named_parameters()}
