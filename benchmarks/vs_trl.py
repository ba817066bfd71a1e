"""Benchmark: bandpo vs TRL's GRPOTrainer, back to back on one machine, at three scales.

    .venv/bin/python -m pip install --target /tmp/trl-site --no-deps trl accelerate   # once, beside the venv
    .venv/bin/python -m benchmarks.vs_trl [--trl-site /tmp/trl-site] [--steps 3] \\
        [--scales tiny,25m,smollm2] [--bf16 auto|true|false] [--out bench_vs_trl.json]

For each scale, TRL first (``benchmarks/trl_step.py``), then bandpo with ``algorithm=grpo``
(``benchmarks/step.py``), each as its own process with the same model, prompts, samples,
new-token limit and optimizer steps per RL step; the load average is printed before and after
each side. Step 1 of each side is warm-up and dropped. Printed (and written as JSON): median
seconds per RL step, generated tokens/s, their ratios (TRL / bandpo: above 1 means bandpo is
faster), and bandpo's start-up (wall time outside its steps), which TRL's number does not have
an equivalent for (its model loads in the benchmark process before timing starts).

Precision (``--bf16``, resolved as ``actor.bf16`` is): ``auto`` (default) runs each side at its best on
this CPU: bf16 where it multiplies bf16 in hardware (avx512_bf16 or amx_bf16), for bandpo
``actor.bf16=true`` (the engines follow the actor's dtype) and for TRL its own mixed precision
(``benchmarks.trl_step --bf16``: fp32 weights and optimizer, bf16 autocast); fp32 on both sides elsewhere.
``true`` / ``false`` force both sides.

Scales:
- ``tiny``: the tiny recipe's model (configs/model/tiny.yaml's cached build), 16 prompts x 32
  samples, at most 48 new tokens, 2 optimizer steps of 8 prompts: overhead-dominated.
- ``25m``: a randomly initialised Qwen2 of ~24M parameters (hidden 512, 8 layers, 8 heads of 64,
  2 KV heads, MLP 1536, the tiny recipe's tokenizer), 8 prompts x 8 samples, at most 128 new
  tokens, 2 optimizer steps of 4 prompts: compute-dominated. A random model rarely samples its
  end-of-sequence token, so most responses on both sides run the full 128 tokens; the tokens/s
  ratio is the comparison that does not depend on lengths.
- ``smollm2``: the real pretrained SmolLM2-135M-Instruct (``model=smollm2-135m``, its cached
  build), 8 prompts x 8 samples, at most 128 new tokens, one optimizer step of 8 prompts in
  micro-batches of 8. Both sides sample at temperature 1.0 (TRL's benchmark script fixes it; the
  recipe's 0.6 would change lengths on both sides alike).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("BANDPO_CACHE", Path.home() / ".cache" / "bandpo")) / "tiny_arith"
SCALES = {
    "tiny": dict(prompts=16, n=32, max_tokens=48, mini_batch_prompts=8, micro_batch_size=64),
    "25m": dict(prompts=8, n=8, max_tokens=128, mini_batch_prompts=4, micro_batch_size=16),
    "smollm2": dict(prompts=8, n=8, max_tokens=128, mini_batch_prompts=8, micro_batch_size=8),
}
# bandpo's overrides per scale beyond the shared ones (the model config brings its tokenizer and lengths).
SCALE_OVERRIDES = {"smollm2": ["model=smollm2-135m", "rollout.temperature=1.0"]}
SIZE_25M = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1536
)


def tiny_model() -> Path:
    """The tiny recipe's warm-started model (built and cached by ``scripts/train.sh`` on first use)."""
    from bandpo.config import compose

    cfg = compose([])
    path = Path(os.path.expanduser(str(cfg.model.path)))
    if not path.exists():
        sys.exit(f"bench_vs_trl: {path} is missing: run scripts/train.sh once to build the tiny model")
    return path


def random_25m_model(tiny: Path) -> Path:
    """A random ~24M-parameter Qwen2 with the tiny recipe's tokenizer and chat template (cached)."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    out = CACHE / "random-25m"
    if (out / "model.safetensors").exists():
        return out
    cfg = AutoConfig.from_pretrained(tiny)
    for key, value in SIZE_25M.items():
        setattr(cfg, key, value)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers  # one entry per layer
    cfg.max_window_layers = cfg.num_hidden_layers
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    tmp = Path(tempfile.mkdtemp(prefix=".random-25m.", dir=CACHE))
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tiny.iterdir():  # tokenizer, chat template, generation config: prompts tokenize identically
        if (
            f.is_file()
            and f.name not in ("model.safetensors", "config.json")
            and not f.name.startswith("bandpo_")
        ):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    print(f"built {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    return out


def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as ``model=smollm2-135m`` resolves it: the Hub's copy, or the build from PyPI."""
    from bandpo.config import compose
    from bandpo.parts import ensure_model

    cfg = compose(["model=smollm2-135m"])
    return Path(ensure_model(cfg.model))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(cmd: list[str], env: dict, label: str) -> None:
    print(f"\n[{label}] load {load()}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            f"bench_vs_trl: {label} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    print(f"[{label}] done, load {load()}", flush=True)


def compare(scale: str, model: Path, steps: int, trl_site: str, workdir: Path, bf16: bool) -> dict:
    s = SCALES[scale]
    py = sys.executable
    trl_json, bandpo_json = workdir / f"trl-{scale}.json", workdir / f"bandpo-{scale}.json"
    trl_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [trl_site, os.environ.get("PYTHONPATH")])),
    }
    run(
        [
            py,
            "-m",
            "benchmarks.trl_step",
            "--steps",
            str(steps),
            "--model-path",
            str(model),
            "--prompts",
            str(s["prompts"]),
            "--n",
            str(s["n"]),
            "--max-tokens",
            str(s["max_tokens"]),
            "--mini-batch-prompts",
            str(s["mini_batch_prompts"]),
            "--micro-batch-size",
            str(s["micro_batch_size"]),
            "--out",
            str(trl_json),
            *(["--bf16"] if bf16 else []),
        ],
        trl_env,
        f"{scale}: TRL",
    )
    run(
        [
            py,
            "-m",
            "benchmarks.step",
            "--steps",
            str(steps),
            "--output-dir",
            str(workdir / f"run-{scale}"),
            "--out",
            str(bandpo_json),
            "--",
            "algorithm=grpo",
            *SCALE_OVERRIDES.get(scale, []),
            f"model.path={model}",
            "model.build=null",
            f"trainer.prompts_per_step={s['prompts']}",
            f"rollout.n={s['n']}",
            f"rollout.max_tokens={s['max_tokens']}",
            f"eval.max_tokens={s['max_tokens']}",
            f"actor.mini_batch_prompts={s['mini_batch_prompts']}",
            f"actor.micro_batch_size={s['micro_batch_size']}",
            "actor.lr=2e-5",
            # TRL has no dynamic sampling
            "algorithm.filter_groups.enable=false",
            f"actor.bf16={str(bf16).lower()}",
        ],
        dict(os.environ),
        f"{scale}: bandpo",
    )
    trl, ours = json.loads(trl_json.read_text())["summary"], json.loads(bandpo_json.read_text())
    b = ours["summary"]
    return {
        "scale": scale,
        "model": str(model),
        "bf16": bf16,
        **s,
        "trl_step_s": trl["median_step_s"],
        "bandpo_step_s": b["step"]["median_s"],
        "trl_tokens_per_s": trl["tokens_per_s"],
        "bandpo_tokens_per_s": b["throughput"]["tokens_per_s"],
        "trl_tokens_per_step": trl["generated_tokens_per_step"],
        "bandpo_tokens_per_step": b["throughput"]["generated_tokens_per_step"],
        "step_ratio_trl_over_bandpo": trl["median_step_s"] / b["step"]["median_s"],
        "tokens_per_s_ratio_bandpo_over_trl": b["throughput"]["tokens_per_s"] / trl["tokens_per_s"],
        "bandpo_startup_s": b["throughput"]["outside_steps_s"],
        "trl_stages_median_s": trl["stages_median_s"],
        "bandpo_stages_median_s": {k: v["median_s"] for k, v in b["stages"].items()},
    }


def main() -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--trl-site", default="/tmp/trl-site", help="folder TRL was installed into (pip --target)"
    )
    ap.add_argument("--steps", type=int, default=3, help="RL steps per side; step 1 is dropped as warm-up")
    ap.add_argument("--scales", default="tiny,25m", help=f"comma-separated, of {list(SCALES)}")
    ap.add_argument(
        "--bf16",
        choices=("auto", "true", "false"),
        default="auto",
        help="both sides in bf16, as actor.bf16 resolves it (auto: where the CPU has avx512_bf16 / amx_bf16)",
    )
    ap.add_argument("--out", default="bench_vs_trl.json")
    args = ap.parse_args()
    scales = args.scales.split(",")
    unknown = [s for s in scales if s not in SCALES]
    if unknown:
        ap.error(f"unknown scale {unknown[0]!r}; valid: {list(SCALES)}")
    if not (Path(args.trl_site) / "trl").is_dir():
        sys.exit(
            f"bench_vs_trl: no TRL in {args.trl_site}; install it beside the venv:\n"
            f"  .venv/bin/python -m pip install --target {args.trl_site} --no-deps trl accelerate"
        )
    from bandpo.distributed.precision import cpu_name
    from benchmarks.common import resolved_bf16

    bf16 = resolved_bf16(args.bf16)
    precision = "bf16" if bf16 else "fp32"
    print(f"{cpu_name()}: both sides in {precision} (--bf16 {args.bf16})", flush=True)
    tiny = tiny_model() if {"tiny", "25m"} & set(scales) else None  # the 25m scale takes its tokenizer
    models = {
        "tiny": tiny,
        "25m": random_25m_model(tiny) if "25m" in scales else None,
        "smollm2": smollm2_model() if "smollm2" in scales else None,
    }
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl.") as tmp:
        rows = [compare(s, models[s], args.steps, args.trl_site, Path(tmp), bf16) for s in scales]
    print(f"\nmachine: {cpu_name()}, {os.cpu_count()} CPUs, {precision}, load {load()} at the end\n")
    print(
        "| scale | TRL s/step | bandpo s/step | TRL / bandpo | tokens/s TRL | tokens/s bandpo | bandpo / TRL "
        "| bandpo start-up s |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['scale']} | {r['trl_step_s']:.2f} | {r['bandpo_step_s']:.2f} | {r['step_ratio_trl_over_bandpo']:.2f}x "
            f"| {r['trl_tokens_per_s']:.0f} | {r['bandpo_tokens_per_s']:.0f} "
            f"| {r['tokens_per_s_ratio_bandpo_over_trl']:.2f}x | {r['bandpo_startup_s']:.1f} |"
        )
    Path(args.out).write_text(
        json.dumps(
            {"machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "bf16": bf16}, "rows": rows}, indent=2
        )
        + "\n"
    )
    print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
