"""Does every engine hold the weights the actor sent? Per-tensor checksums on both sides, compared.

Run by the trainer after the first sync of a run and, with ``rollout.verify_sync=true``, after
every sync, whatever the transport: the engine side is one call into each engine
(``RolloutEngine.weight_checksums``; on vLLM a ``collective_rpc`` into every worker), the actor
side one more pass over the same named weights the transport sent (``ActorStateIO.weight_checksums``).

The checksum of a tensor is the exact integer sum of its elements' bit patterns, read as signed
integers of the element's width (int16 for bf16 / fp16, int32 for fp32), summed in int64, after
-0.0 is made +0.0 (a GEMM that reproduces a weight may return either zero). Exact: no rounding,
so the comparison is equality and no tolerance is needed; |sum| < 2^31 * numel stays below 2^63
for any tensor under 2^32 elements. Any change to one element changes the sum by the difference
of its two bit patterns, never 0. It is additive, so a fused engine tensor (vLLM's ``qkv_proj``
= q, k, v stacked along the output dim; ``gate_up_proj``) can be cut back into checkpoint tensors
by rows, and tensor-parallel shards add up to the whole. Padding rows (vLLM pads the vocabulary
with zeros) are cut away. The actor's tensor is cast to the engine's dtype first, as the engine's
load does, so a bf16 engine fed fp32 weights compares the bf16 it really holds.

What the engine reads is what it samples with: on CPU, vLLM drops a linear layer's ``weight`` once
it has packed it for oneDNN, and the logits GEMM reads a packed copy of ``lm_head`` (of the
embedding when tied); those weights are read back through the layer's own GEMM applied to an
identity matrix (1 * w summed with exact zeros: the GEMM returns w exactly). That read-back costs
2 k FLOPs per weight (k: the layer's input size), the only part of a check that is not a pass over
memory: 0.03 s for the tiny test model on 2 cores.

A report is a list of ``EngineEntry`` per engine worker (one per tensor-parallel rank). Nothing
here imports vLLM, Ray or the rollout package: the vLLM model is walked by duck typing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ray.actor import ActorHandle

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32}
PROBE_ELEMENTS = 1 << 24  # output elements per identity-probe GEMM (64 MiB in fp32)


class WeightSyncMismatch(RuntimeError):
    """An engine does not hold the weights the actor sent (names the tensor and the engine)."""


class EngineEntry(NamedTuple):
    """One engine tensor's checksum: ``label`` is where the engine holds it, ``name`` the checkpoint
    tensor it must equal; ``copies``: tensor-parallel ranks holding each of its shards (vLLM's
    replicated KV heads; 1 otherwise)."""

    label: str
    name: str
    dtype: str
    numel: int
    checksum: int
    copies: int = 1


def checksum(t: torch.Tensor) -> int:
    """The exact sum of ``t``'s bit patterns (module docstring), any device, as a Python int."""
    t = t.detach()
    if t.is_floating_point():
        t = t.masked_fill(t == 0, 0)  # -0.0 -> +0.0
    flat = t.contiguous().reshape(-1)
    if flat.element_size() not in _INT_OF_WIDTH:  # 8-byte elements: as int32 pairs
        flat = flat.view(torch.int32)
    if flat.numel() >= 1 << 32:
        raise ValueError(f"checksum: a tensor of {flat.numel()} elements could overflow int64; split it")
    return int(flat.view(_INT_OF_WIDTH[flat.element_size()]).sum(dtype=torch.int64))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entries_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[EngineEntry]:
    """Entries of tensors an engine holds under their checkpoint names (the transformers engine)."""
    return [EngineEntry(n, n, _dtype_name(t.dtype), t.numel(), checksum(t)) for n, t in named]


def actor_checksums(named: Iterable[tuple[str, torch.Tensor]], dtypes: dict[str, list[str]]) -> dict:
    """Per sent tensor, {dtype: (numel, checksum)} of it cast to each dtype the engines hold it in
    (``dtypes``: name -> dtype names), or in its own dtype when no engine asked for it."""
    out = {}
    for name, t in named:
        wanted = dtypes.get(name) or [_dtype_name(t.dtype)]
        out[name] = {d: (t.numel(), checksum(t.to(getattr(torch, d)))) for d in wanted}
    return out


def requested_dtypes(reports: list[list[list[EngineEntry]]]) -> dict[str, list[str]]:
    """Checkpoint name -> the dtypes the engines hold it in, from every engine's report."""
    out: dict[str, list[str]] = {}
    for engine in reports:
        for worker in engine:
            for e in map(EngineEntry._make, worker):
                if e.dtype not in out.setdefault(e.name, []):
                    out[e.name].append(e.dtype)
    return out


def compare(actor: dict, reports: list[list[list[EngineEntry]]]) -> int:
    """Raise ``WeightSyncMismatch`` at the first engine tensor that differs from what the actor sent,
    or that one side has and the other lacks. ``actor``: ``actor_checksums``' result; ``reports[i][w]``:
    engine i's worker (tensor-parallel rank) w's entries. Returns the number of entries checked.

    Over tensor-parallel ranks: a tensor each rank holds whole (as many elements as the actor's)
    is checked on each rank; otherwise the ranks' shards must add up to it, each counted ``copies`` times.
    """
    checked = 0
    for i, engine in enumerate(reports):
        groups: dict[tuple[str, str], list[tuple[int, EngineEntry]]] = {}
        for w, worker in enumerate(engine):
            for e in map(EngineEntry._make, worker):
                groups.setdefault((e.label, e.name), []).append((w, e))
        held = {name for _, name in groups}
        missing = [n for n in actor if n not in held]
        if missing:
            raise _mismatch(
                f"engine {i} holds no tensor for {missing[0]} (sent by the actor; {len(missing)} "
                f"such in all), so it keeps weights the actor never sent"
            )
        for (label, name), shards in groups.items():
            where = f"engine {i} tensor {label}" + ("" if label == name else f" (checkpoint tensor {name})")
            if name not in actor:
                raise _mismatch(f"{where} is not among the tensors the actor sent, so it keeps its old value")
            for w, e in shards:
                _compare_one(actor[name], e, f"{where}, TP rank {w}", whole_only=len(shards) == 1)
            if len(shards) > 1 and any(e.numel != actor[name][e.dtype][0] for _, e in shards):
                _compare_sum(actor[name], [e for _, e in shards], f"{where}, summed over its TP ranks")
            checked += len(shards)
    return checked


def _compare_one(sent: dict, e: EngineEntry, where: str, whole_only: bool) -> None:
    numel, expected = sent[e.dtype]
    if e.numel != numel:
        if whole_only:
            raise _mismatch(f"{where} has {e.numel} elements, the actor sent {numel}")
        return  # a shard: checked by _compare_sum
    if e.checksum != expected:
        raise _mismatch(
            f"{where} differs from the actor's: checksum {e.checksum} vs {expected} over {numel} "
            f"{e.dtype} elements"
        )


def _compare_sum(sent: dict, shards: list[EngineEntry], where: str) -> None:
    copies = shards[0].copies
    numel, expected = sent[shards[0].dtype]
    total_numel, total = sum(e.numel for e in shards), sum(e.checksum for e in shards)
    if total_numel != numel * copies or total != expected * copies:
        raise _mismatch(
            f"{where} differs from the actor's: {total_numel} elements with checksum {total} vs "
            f"{numel} x {copies} copies with checksum {expected} each"
        )


def _mismatch(what: str) -> WeightSyncMismatch:
    return WeightSyncMismatch(f"weight sync verification: {what}")


# ---- the vLLM model, walked by duck typing (runs inside each vLLM worker) -------------------------------


def module_entries(model: torch.nn.Module, head: torch.nn.Module | None = None) -> list[EngineEntry]:
    """Entries of every parameter of a vLLM model under checkpoint names.

    Fused linears are cut by ``output_partition_sizes`` into the parts the model's
    ``packed_modules_mapping`` names (in that order); vocabulary padding rows are dropped; a linear
    whose weight was packed away (CPU) is read through its GEMM. ``head``: the module the logits GEMM
    runs on; when it holds a packed copy of its weight (CPU), that copy is checked too.
    """
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[EngineEntry] = []
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = names.get(id(p), f"{mod_name}.{pname}")
            if full != f"{mod_name}.{pname}":
                continue  # shared (tied): reported under its first name
            if pname == "weight" and p.numel() == 0 and hasattr(module, "quant_method"):
                parts = _probe_parts(module, list(getattr(module, "output_partition_sizes", [None])))
            else:
                parts = _tensor_parts(module, p)
            out += _split(module, full, _dtype_name(p.dtype), packed, parts)
    if head is not None and hasattr(head, "cpu_linear") and head.weight.numel() > 0:
        name = names[id(head.weight)]
        rows = _org_rows(head)
        label = "lm_head GEMM copy" + (f" (tied to {name})" if not name.startswith("lm_head") else "")
        [(numel, total)] = _probe_parts(head, [rows], out_features=head.weight.shape[0])
        out.append(EngineEntry(label, name, _dtype_name(head.weight.dtype), numel, total))
    return out


def _org_rows(module) -> int | None:
    """Rows of a vocabulary-parallel table that hold real tokens (the rest is zero padding)."""
    indices = getattr(module, "shard_indices", None)
    return None if indices is None else int(indices.num_org_elements)


def _tensor_parts(module, p: torch.Tensor) -> list[tuple[int, int]]:
    """(numel, checksum) of each output-row part of parameter ``p`` (one part unless fused)."""
    sizes = getattr(module, "output_partition_sizes", None)
    if sizes is not None and len(sizes) > 1 and p.ndim >= 1 and p.shape[0] == sum(sizes):
        return [(c.numel(), checksum(c)) for c in torch.split(p.data, list(sizes), 0)]
    rows = _org_rows(module)
    data = p.data[:rows] if rows is not None and p.ndim >= 1 else p.data
    return [(data.numel(), checksum(data))]


@torch.no_grad()
def _probe_parts(module, sizes: list[int | None], out_features: int | None = None) -> list[tuple[int, int]]:
    """(numel, checksum) of each output-row part of a linear layer's weight [N, K], read through the
    layer's GEMM: y = x @ w.T with x the identity rows k0..k1 gives w[:, k0:k1].T exactly."""
    w = module.weight
    k = int(
        getattr(module, "input_size_per_partition", 0) or getattr(module, "embedding_dim", 0) or w.shape[-1]
    )
    n = out_features or sum(s for s in sizes if s is not None) or int(module.output_size_per_partition)
    cuts = [s if s is not None else n for s in sizes]
    keep = sum(cuts)  # rows past the parts (vocabulary padding) are not the checkpoint's
    totals = [[0, 0] for _ in cuts]
    step = max(1, PROBE_ELEMENTS // max(n, 1))
    for k0 in range(0, k, step):
        k1 = min(k, k0 + step)
        x = torch.zeros(k1 - k0, k, dtype=w.dtype, device=w.device)
        x[:, k0:k1].fill_diagonal_(1)
        y = module.quant_method.apply(module, x)  # [k1 - k0, n]
        if y.shape != (k1 - k0, n):
            raise RuntimeError(
                f"verify: the GEMM of a {type(module).__name__} returned {tuple(y.shape)} for "
                f"{k1 - k0} identity rows, expected {(k1 - k0, n)}"
            )
        for part, chunk in zip(totals, torch.split(y[:, :keep], cuts, 1)):
            part[0] += chunk.numel()
            part[1] += checksum(chunk)
    return [tuple(t) for t in totals]


def _split(
    module, full: str, dtype: str, packed: dict[str, list[str]], parts: list[tuple[int, int]]
) -> list[EngineEntry]:
    """Name each part: the fused module's checkpoint modules (``packed``), in order, or ``full`` itself.
    The k and v parts of a fused qkv count each KV head's ``num_kv_head_replicas`` copies."""
    if len(parts) == 1:
        return [EngineEntry(full, full, dtype, *parts[0])]
    prefix, fused, pname = _name_parts(full)
    sub = packed.get(fused)
    if sub is None or len(sub) != len(parts):
        raise RuntimeError(
            f"verify: {full} holds {len(parts)} fused tensors but the model's "
            f"packed_modules_mapping names {sub} for {fused}"
        )
    kv = getattr(module, "num_kv_head_replicas", None)
    return [
        EngineEntry(full, f"{prefix}{s}.{pname}", dtype, numel, total, kv if kv and j > 0 else 1)
        for j, (s, (numel, total)) in enumerate(zip(sub, parts))
    ]


def _name_parts(full: str) -> tuple[str, str, str]:
    """ "a.b.qkv_proj.weight" -> ("a.b.", "qkv_proj", "weight")."""
    head, pname = full.rsplit(".", 1)
    prefix, _, fused = head.rpartition(".")
    return (prefix + "." if prefix else ""), fused, pname


# ---- the driver -------------------------------------------------------------------------------------


def verify_engines(actors: list[ActorHandle], engines: list[ActorHandle], timeout_s: float) -> int:
    """Compare every engine's weights with the actor's (``compare``); returns the entries checked.

    Collective on the actor: every rank runs ``weight_checksums`` (ZeRO-3 gathers bucket by bucket),
    rank 0 returns them. Each side's wait ends after ``timeout_s`` (``rollout.weight_sync_timeout``)
    with a ``WeightSyncTimeout`` naming the engines or ranks that had not answered.
    """
    from bandpo.weight_sync.waits import ACTOR_HINT, ENGINE_HINT, get_within

    reports = get_within(
        [e.weight_checksums.remote() for e in engines],
        timeout_s,
        "the engines' weight checksums",
        ENGINE_HINT,
        names=[f"rollout engine {i}" for i in range(len(engines))],
    )
    wanted = requested_dtypes(reports)
    sent = get_within(
        [a.weight_checksums.remote(wanted) for a in actors],
        timeout_s,
        "the actor's weight checksums",
        ACTOR_HINT,
        names=[f"actor rank {r}" for r in range(len(actors))],
    )[0]
    return compare(sent, reports)
