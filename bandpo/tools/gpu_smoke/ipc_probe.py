"""CUDA IPC of a weight bucket under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, across two processes.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m bandpo.tools.gpu_smoke.ipc_probe

Two rounds, each a bucket sent to a spawned process that maps it and returns its checksum:
  packed   ``bandpo.weight_sync.ipc.pack_ipc_bucket`` (the bucket allocated with expandable segments
           off): must map everywhere, the checksum equal to the sender's
  control  the same bytes in a tensor taken from the expandable pool: its IPC goes through
           ``pidfd_getfd``, which needs ptrace rights (refused by Ubuntu's Yama default and by
           unprivileged containers: "pidfd_getfd: Operation not permitted"); as root it may map
Prints one JSON line per round and exits 0 when the packed round matched, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time


def _receiver(inbox, outbox) -> None:
    import torch

    from bandpo.weight_sync.ipc import open_ipc_bucket

    torch.cuda.set_device(0)
    while (msg := inbox.get()) is not None:
        kind, payload = msg
        try:
            if kind == "packed":
                total = sum(float(v.double().sum()) for _, v in open_ipc_bucket(payload))
            else:
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                args = list(pickle.loads(payload))
                args[6] = 0
                total = float(rebuild_cuda_tensor(*args).double().sum())
            outbox.put({"ok": True, "sum": total})
        except Exception as e:  # reported to the parent: the error is the finding
            outbox.put({"ok": False, "error": f"{type(e).__name__}: {e}"})


def main() -> int:
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    from bandpo.weight_sync.ipc import alloc_conf, expandable_segments_on, pack_ipc_bucket

    conf = alloc_conf()
    print(
        json.dumps({"PYTORCH_CUDA_ALLOC_CONF": conf, "expandable": expandable_segments_on(conf)}), flush=True
    )
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # [4096, 4096] bf16 x 4: 128 MiB of weights, allocated from the expandable pool first
    named = [(f"w{i}", torch.randn(4096, 4096, device="cuda", generator=gen).bfloat16()) for i in range(4)]
    want = sum(float(t.double().sum()) for _, t in named)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(inbox, outbox), daemon=True)
    proc.start()
    rows = []
    try:
        t0 = time.perf_counter()
        uuid, payload, buf = pack_ipc_bucket(named)
        inbox.put(("packed", {uuid: payload}))
        got = outbox.get(timeout=120)
        rows.append({"round": "packed", "s": round(time.perf_counter() - t0, 3), "want": want, **got})
        del buf
        flat = torch.cat([t.reshape(-1) for _, t in named])  # taken from the expandable pool
        _, args = reduce_tensor(flat)
        inbox.put(("control", pickle.dumps(args)))
        got = outbox.get(timeout=120)
        rows.append({"round": "control", "want": float(flat.double().sum()), **got})
    except Exception as e:
        rows.append({"round": "error", "ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        inbox.put(None)
        proc.join(timeout=30)
    for row in rows:
        print(json.dumps(row), flush=True)
    packed = rows[0] if rows and rows[0]["round"] == "packed" else {}
    ok = bool(packed.get("ok")) and abs(packed["sum"] - packed["want"]) <= 1e-6 * max(
        1.0, abs(packed["want"])
    )
    print(f"ipc probe: packed bucket {'OK' if ok else 'FAILED'} (pid {os.getpid()})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
