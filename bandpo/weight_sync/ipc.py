"""CUDA IPC buckets: the colocated layout's transport (``rollout.weight_sync=ipc``).

Per bucket of parameters (gathered bucket by bucket under ZeRO-3), every actor rank copies the
bucket into one CUDA buffer on its own GPU (the flat format of ``bandpo.flat_buffer``) and
shares it by IPC handle; rank 0 collects every rank's handle, keyed by GPU UUID, and hands them
to each engine, whose workers each map the buffer on their own GPU and load views of it
(``open_ipc_bucket``). The weights never pass through host memory: a GPU -> GPU copy into the
bucket and the engine's load from it. Extra GPU memory: one bucket per rank. Every rank keeps
its bucket alive until rank 0 has seen every engine load it; a rank that fails ends every rank's
sync at the next exchange (``send_ipc``).

GPUs are matched by UUID because CUDA_VISIBLE_DEVICES (set per Ray actor) gives one GPU
different indices in different processes.

The bucket is allocated with PyTorch's expandable segments off (``no_expandable_segments``), whatever
PYTORCH_CUDA_ALLOC_CONF says (it is forwarded to every rank): CUDA IPC of an expandable segment goes
through ``pidfd_getfd``, which needs ptrace rights that Ubuntu's Yama default and unprivileged
containers refuse ("pidfd_getfd: Operation not permitted"), while a plain cudaMalloc segment is shared
by cudaIpcGetMemHandle. PyTorch's caching allocator honours the switch for a single request (it skips
its expandable blocks while the setting is off), so the rest of the rank keeps its expandable segments.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from bandpo.flat_buffer import layout, metas_from_wire, metas_to_wire, views
from bandpo.weight_sync.waits import DEFAULT_TIMEOUT_S, ENGINE_HINT, get_within

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def gpu_uuid(index: int | None = None) -> str:
    """The UUID of CUDA device ``index`` (default: the current one), the same in every process."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


# Torch's names for its allocator settings, in its order of precedence (the accelerator-agnostic one wins).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments"


def alloc_conf(environ=None) -> str:
    """The allocator settings this process started with. Nothing in an actor rank rewrites them at run
    time (vLLM does, in the engines' processes only), so the environment is what is in effect."""
    environ = os.environ if environ is None else environ
    return next((environ[k] for k in ALLOC_CONF_VARS if environ.get(k)), "")


def expandable_segments_on(conf: str) -> bool:
    for field in conf.split(","):
        name, _, value = field.partition(":")
        if name.strip() == EXPANDABLE:
            return value.strip().lower() in ("true", "1")
    return False


def with_expandable_segments(conf: str, on: bool) -> str:
    """``conf`` with the expandable-segments field set to ``on``, every other field kept: torch resets
    each option that the string it is handed leaves out, so the whole string is always written."""
    want = f"{EXPANDABLE}:{on}"
    fields = [f.strip() for f in conf.split(",") if f.strip()]
    kept = [want if f.partition(":")[0].strip() == EXPANDABLE else f for f in fields]
    return ",".join(kept if want in kept else [*kept, want])


def _set_alloc_conf(conf: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(conf)


@contextmanager
def no_expandable_segments(conf: str | None = None):
    """Expandable segments off inside the block when ``conf`` (default: ``alloc_conf()``) turns them on;
    the settings are written back on the way out, also when the block fails. A no-op otherwise."""
    conf = alloc_conf() if conf is None else conf
    if not expandable_segments_on(conf):
        yield
        return
    _set_alloc_conf(with_expandable_segments(conf, False))
    try:
        yield
    finally:
        _set_alloc_conf(conf)


def pack_ipc_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[str, bytes, torch.Tensor]:
    """Copy CUDA tensors into one buffer on their GPU; return (GPU UUID, pickled IPC handle + metas,
    the buffer, which the caller keeps alive until every reader has loaded it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    metas, tensors, total = layout(named)
    with no_expandable_segments():  # shareable by cudaIpcGetMemHandle (module docstring)
        buf = torch.empty(max(total, 1), dtype=torch.uint8, device=tensors[0].device)
    for (_, view), t in zip(views(buf, metas), tensors):
        view.copy_(t.detach())
    # The reader works on its own stream in another process: the copies must have landed.
    torch.cuda.current_stream(buf.device).synchronize()
    _, args = reduce_tensor(buf)
    return gpu_uuid(buf.device.index), pickle.dumps({"args": args, "metas": metas_to_wire(metas)}), buf


def open_ipc_bucket(payloads: dict[str, bytes]) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiving side: map the bucket packed on this process's current GPU and yield ``(name, view)``.

    ``payloads``: GPU UUID -> payload of ``pack_ipc_bucket`` (one per actor rank).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    here = torch.cuda.current_device()
    uuid = gpu_uuid(here)
    if uuid not in payloads:
        raise RuntimeError(
            f"no actor rank packed a weight bucket on this engine's GPU {uuid} (ranks' GPUs: "
            f"{sorted(payloads)}); rollout.weight_sync=ipc needs the colocated layout"
        )
    msg = pickle.loads(payloads[uuid])  # payload comes from our own actor ranks, never from users
    args = list(msg["args"])
    args[6] = here  # reduce_tensor's args: index 6 is the storage's device index, local to the sender
    buf = rebuild_cuda_tensor(*args)
    yield from views(buf, metas_from_wire(msg["metas"]))


def exchange(
    all_gather: Callable[[object], list], mine: object, failure: BaseException | None, stage: str
) -> list:
    """Every rank's ``mine`` in rank order, exchanged with whether each rank is still fine: when one
    failed, every rank raises here (the failed rank its own error, the others one naming it), so none
    is left waiting in the next collective for a rank that is gone."""
    sent = ("failed", f"{type(failure).__name__}: {failure}") if failure is not None else ("ok", mine)
    entries = all_gather(sent)
    if failure is not None:
        raise failure
    failed = [(rank, what) for rank, (status, what) in enumerate(entries) if status != "ok"]
    if failed:
        rank, what = failed[0]
        raise RuntimeError(f"weight sync: actor rank {rank} failed {stage}: {what}")
    return [what for _, what in entries]


def _attempt(fn: Callable[[], object]) -> BaseException | None:
    """``fn()``'s exception, or None: a rank's failure waits for the next exchange to be raised."""
    try:
        fn()
    except Exception as e:
        return e
    return None


def send_ipc(
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    engines: list[ActorHandle],
    *,
    driver: bool,
    all_gather: Callable[[object], list],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> int:
    """One actor rank's side of an IPC sync: every rank packs each bucket, ``driver`` (rank 0) loads
    it into every engine (``RolloutWorker.ipc_update``). Collective: all ranks call it with the same
    buckets. ``all_gather``: the ranks' all-gather of a picklable object. Returns the bucket count.

    Per bucket two exchanges (``exchange``): the packed handles, then whether the engines loaded
    them, which also keeps every rank's bucket alive until they have. A rank that fails (packing,
    or rank 0 driving the engines: an engine's error, a wait past ``timeout_s``) says so at the next
    exchange and every rank raises there. The ZeRO-3 gathers between buckets are collectives too:
    all ranks leave the bucket loop at the same exchange, so none is left in one.
    """
    failure = None
    if driver:
        failure = _attempt(
            lambda: get_within(
                [e.ipc_update.remote("begin") for e in engines],
                timeout_s,
                "the engines' begin of an IPC sync",
                ENGINE_HINT,
            )
        )
    count = 0
    try:
        for bucket in buckets:
            packed = None
            if failure is None:
                try:
                    packed = pack_ipc_bucket(bucket)
                except Exception as e:
                    failure = e
            by_gpu = dict(
                exchange(all_gather, packed[:2] if packed else None, failure, f"packing bucket {count}")
            )
            if driver:
                failure = _attempt(
                    lambda: get_within(
                        [e.ipc_update.remote("load", by_gpu) for e in engines],
                        timeout_s,
                        "the engines' load of a bucket",
                        ENGINE_HINT,
                    )
                )
            exchange(all_gather, None, failure, f"loading bucket {count} into the engines")
            del packed  # this rank's buffer: every engine has loaded it
            count += 1
    except BaseException as e:
        if driver:  # the engines' side of the sync ends either way; the first error is the one raised
            done = _attempt(
                lambda: get_within(
                    [en.ipc_update.remote("finish") for en in engines],
                    timeout_s,
                    "the engines' finish of an IPC sync",
                    ENGINE_HINT,
                )
            )
            if done is not None:
                e.add_note(f"finishing the engines' IPC sync failed too: {done}")
        raise
    if driver:
        get_within(
            [e.ipc_update.remote("finish") for e in engines],
            timeout_s,
            "the engines' finish of an IPC sync",
            ENGINE_HINT,
        )
    return count
