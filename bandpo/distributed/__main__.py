"""``python -m bandpo.distributed [--nodes N --gpus-per-node G] [--check] [--json] OVERRIDES...``

Composes the training config from ``OVERRIDES`` and prints its placement plan (node, GPU,
actor rank, engine/TP shard of every worker) and the per-GPU memory of its start-up, rollout
and train phases (``bandpo.distributed.memory``), without loading a model. The cluster shape is
``--nodes`` x ``--gpus-per-node``, else ``trainer.nnodes`` x ``trainer.gpus_per_node``, else
the Ray cluster at ``trainer.ray_address`` / ``$RAY_ADDRESS``, else this machine. ``--check``
places stand-ins with the real workers' Ray options on a simulated cluster of that shape
(``bandpo.distributed.check``). The GPU's memory is ``--gpu-gib``,
else ``trainer.gpu_memory_gib``, else what this machine's GPU reports; unknown, the fit is not
checked. Exit codes: 0 fits (and with ``--check`` every invariant holds), 1 an invariant failed,
2 a config error or a phase that does not fit the GPU's memory (``--json``: ``"memory_gib"``,
and ``"lora"``: with LoRA on its rank, targets, adapter and base parameters, else null).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bandpo.config import compose
from bandpo.distributed import plan as plan_module
from bandpo.distributed.check import check_plan
from bandpo.distributed.memory import estimate_for, memory_errors, memory_table
from bandpo.distributed.plan import (
    ClusterShape,
    decide_device,
    detect_shape,
    make_plan,
    planned_json,
    shape_from_config,
    table,
)
from bandpo.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bandpo.distributed", description=plan_module.__doc__.splitlines()[0]
    )
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--cpus-per-node", type=int, help="simulated nodes' CPUs (default: what the plan needs)")
    ap.add_argument(
        "--gpu-gib",
        type=float,
        help="one GPU's memory in GiB (default: trainer.gpu_memory_gib, "
        "else what this machine's GPU reports)",
    )
    ap.add_argument("--check", action="store_true", help="place stand-ins on a simulated Ray cluster")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # overrides before and after the flags
    try:
        cfg = compose(args.overrides)
        shape = shape_from_config(cfg)
        if args.nodes or args.gpus_per_node:
            shape = ClusterShape(args.nodes or 1, args.gpus_per_node if args.gpus_per_node is not None else 8)
        if shape is None:
            shape = detect_shape(cfg.trainer.ray_address)
        plan = make_plan(cfg, shape, decide_device(cfg.trainer.device, shape.gpus_per_node))
        est = estimate_for(cfg, plan, shape, args.gpu_gib)
    except ConfigError as e:
        print(
            json.dumps({"workers": [], "ok": False, "error": str(e)}) if args.json else e,
            file=sys.stdout if args.json else sys.stderr,
        )
        return 2
    too_big = memory_errors(est)
    memory = {
        "memory": None if est is None else est.parts,
        "memory_gib": None if est is None else est.as_json(),
        "lora": None if est is None else est.lora,
    }
    if too_big:  # a phase does not fit the GPU's memory: the plan, then what is missing
        if args.json:
            print(
                json.dumps(
                    {
                        "workers": planned_json(plan),
                        "ok": False,
                        "layout": plan.layout,
                        **memory,
                        "error": "\n".join(too_big),
                    }
                )
            )
        else:
            print(table(plan) + "\n" + memory_table(est, plan))
            print("\n".join(too_big), file=sys.stderr)
        return 2
    if not args.check:
        if args.json:
            print(json.dumps({"workers": planned_json(plan), "ok": True, "layout": plan.layout, **memory}))
        else:
            print(table(plan) + "\n" + memory_table(est, plan))
        return 0
    stdout = sys.stdout
    if args.json:
        # Ray's own messages (raylet warnings, started processes) go to stderr: stdout is the JSON alone.
        sys.stdout.flush()
        stdout = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    report = check_plan(plan, cpus_per_node=args.cpus_per_node)
    if args.json:
        print(json.dumps({**report, "layout": plan.layout, **memory}), file=stdout, flush=True)
    else:
        print(table(plan) + "\n" + memory_table(est, plan))
        print(f"vLLM Ray executor modelled: {report['executor']}")
        for w in report["workers"]:
            print(
                f"  {w['group']:<8} rank {w['rank']:>2} shard {w['shard']}  node {w['node'][:12]}  "
                f"Ray GPUs {w['gpus']}  computes on {w.get('device')}  "
                f"CUDA_VISIBLE_DEVICES={w.get('cuda_visible_devices')}"
            )
        print("\n".join(f"FAIL: {e}" for e in report["errors"]) or "all invariants hold")
        print(f"check took {report['seconds']:.1f} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
