"""A LoRA model's weights as PEFT names them, without importing PEFT: the base model's name of each
parameter, the adapter factors, and a target's weight merged with its factors.

PEFT wraps every target ``nn.Linear`` (``bandpo.actor.lora.apply_lora``): its frozen weight W [out, in]
becomes ``<module>.base_layer.weight`` under the wrapper's ``base_model.model.`` prefix, and its factors
A [rank, in] and B [out, rank] are ``<module>.lora_A.default.weight`` and ``<module>.lora_B.default.weight``.
The merged weight is ``W + s * (B @ A)``, s = alpha / rank.

The actor uses these for the merged sync and the adapter's gather; ``bandpo.checkpoint`` for the HF
export of a LoRA run, the merge of a training checkpoint for evaluation and the adapter folder's
names. They live outside both so that ``bandpo.checkpoint`` imports nothing from ``bandpo.actor``
(which imports it); torch is the only dependency.
"""

from __future__ import annotations

import torch

# PEFT's module path segments: the wrapper's prefix, the frozen layer's, the adapter factors'.
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"
ADAPTER = "default"  # get_peft_model's adapter name


def is_lora(module: torch.nn.Module) -> bool:
    """Whether ``module`` (an HF model, a PEFT model, or a DeepSpeed engine around one) carries adapters."""
    return hasattr(getattr(module, "module", module), "disable_adapter")


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a PEFT wrapper (with its adapter layers in place), else ``module``."""
    return module.get_base_model() if is_lora(module) else module


def base_name(name: str) -> str | None:
    """The base model's name of the PEFT parameter ``name``; None for an adapter factor.

    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``.
    """
    if ".lora_" in name:
        return None
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(BASE_LAYER + ".", ".")


def merged_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``W + scaling * (B @ A)`` as a new tensor in ``weight``'s dtype; the inputs are not written.

    weight [out, in], lora_a [rank, in], lora_b [out, rank]. In float32 the operations and their
    order are PEFT's merge (``(B @ A) * scaling``, then added), so the result equals
    ``merge_and_unload``'s bit for bit. In lower precision the sum is formed in float32 and rounded
    once, the best the dtype holds of ``W + s B A``; PEFT rounds the product ``d`` first, then the
    sum. With u the dtype's unit roundoff (eps / 2) the two differ by at most about
    ``2u |W + d| + u |d|``: not a bound relative to the result where ``W`` and ``d`` cancel.
    """
    if weight.dtype == torch.float32:
        return weight + (lora_b @ lora_a) * scaling
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (weight.float() + delta).to(weight.dtype)


def merge_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict (``state``, e.g. consolidated from a training checkpoint) as the base
    model's: base names, each target's weight merged (``merged_weight``), the factors dropped.

    Raises ValueError naming the module whose factor or base weight is missing.
    """
    out = {}
    for name, t in state.items():
        base = base_name(name)
        if base is None:
            continue
        prefix = name[: -len(BASE_LAYER + ".weight")] if name.endswith(BASE_LAYER + ".weight") else None
        a_name, b_name = f"{prefix}.lora_A.{ADAPTER}.weight", f"{prefix}.lora_B.{ADAPTER}.weight"
        if prefix is not None and (a_name in state or b_name in state):
            if a_name not in state or b_name not in state:
                raise ValueError(f"LoRA state of {prefix}: lora_A or lora_B is missing")
            t = merged_weight(t, state[a_name].to(t.dtype), state[b_name].to(t.dtype), scaling)
        out[base] = t
    unmerged = {n.split(".lora_")[0] for n in state if ".lora_" in n} - {
        n[: -len(BASE_LAYER + ".weight")] for n in state if n.endswith(BASE_LAYER + ".weight")
    }
    if unmerged:
        raise ValueError(f"LoRA factors without a base weight: {sorted(unmerged)[:3]}")
    return out


def lora_factors(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter factors (``lora_A`` / ``lora_B`` weights) of ``module`` in ``named_parameters`` order:
    what the adapter file holds and, under ZeRO-3, what its writing gathers."""
    return [p for name, p in module.named_parameters() if ".lora_" in name]
