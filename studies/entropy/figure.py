"""The entropy test's headline figure, drawn from stage 2's records alone.

Four panels, one colour an arm (GRPO, BandPO), one line style a seed:
- the probe entropy over the base model's, H / H(0), every 5 steps (the verdict's measure; the
  dotted line is the collapse its rules need of GRPO, 0.5);
- the rollout entropy of the training batches (the actor's, per step; a denser but moving target:
  each step's batch is other prompts);
- the share of the update's tokens whose gradient the clip removed, by sign: up (A > 0, ratio above
  the upper bound: the high-advantage tokens the claim is about) and down (A < 0), per step;
- held-out mean@8 on the accuracy endpoint's set at steps 0, 30 and 60 (the base model at step 0).

    python -m studies.entropy.figure [--records DIR] [--out PNG]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from studies.entropy import design
from studies.entropy import verdict as v

COLORS = {"grpo": "tab:red", "bandpo": "tab:blue"}
STYLES = ("-", "--", ":")  # seeds 0, 1, 2
Points = list[tuple[int, float]]


def _by_step(rows: list[dict], key: str, scale: float) -> Points:
    return [(r["step"], scale * r[key]) for r in rows if key in r]


def series(records: Path) -> dict[str, dict[str, Points]]:
    """Per run (``grpo-s0`` ...), what each panel draws: ``probe`` (step, H / H(0)) from step 0 (1.0);
    ``rollout`` (step, actor entropy in nats); ``up`` and ``down`` (step, % of the update's tokens);
    ``mean@8`` (step, % on the endpoint set). Runs without a record are left out."""
    data = v.collect(records)
    h0, evals = data["h0"], data["evals"]
    out: dict[str, dict[str, Points]] = {}
    for arm, seed in design.plan():
        name = design.run_name(arm, seed)
        rows = v.metrics_rows(records, name)
        probe = sorted(data["h"][name].items())
        if not rows and not probe:
            continue
        acc = [
            (step, 100 * evals[key][design.ENDPOINT_SET]["mean@8"])
            for step in (0, *design.EVALS)
            if (key := ("base" if step == 0 else name, step)) in evals and design.ENDPOINT_SET in evals[key]
        ]
        out[name] = {
            "probe": ([(0, 1.0)] if h0 else []) + [(s, h / h0) for s, h in probe if h0],
            "rollout": _by_step(rows, "actor/entropy", 1),
            "up": _by_step(rows, "actor/clip_frac_up", 100),
            "down": _by_step(rows, "actor/clip_frac_down", 100),
            "mean@8": acc,
        }
    return out


def draw(runs: dict[str, dict[str, Points]], png: Path) -> Path:
    """The four panels of ``series``' output into ``png``."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    from bandpo.viz import save_figure

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.3))
    ax_p, ax_r, ax_c, ax_a = axes
    for name, s in runs.items():
        arm, seed = name.rsplit("-s", 1)
        style = dict(color=COLORS.get(arm, "0.4"), ls=STYLES[int(seed) % len(STYLES)], lw=1.6)
        label = f"{arm} seed {seed}"
        for ax, key in ((ax_p, "probe"), (ax_r, "rollout"), (ax_a, "mean@8")):
            if s[key]:
                ax.plot(*zip(*s[key]), marker="o" if key != "rollout" else None, ms=3, label=label, **style)
        if s["up"]:
            ax_c.plot(*zip(*s["up"]), label=f"{label}: up (A > 0)", **style)
        if s["down"]:
            ax_c.plot(*zip(*s["down"]), label=f"{label}: down (A < 0)", alpha=0.35, **{**style, "lw": 1.0})
    ax_p.axhline(v.COLLAPSE, color="0.3", ls=":", lw=1.0, label=f"collapse the rules need ({v.COLLAPSE})")
    ax_p.set(title="probe entropy / base model's", xlabel="step", ylim=(0, None))
    ax_r.set(title="rollout entropy of the training batch (nats/token)", xlabel="step")
    ax_c.set(title="update tokens whose gradient the clip removed (%)", xlabel="step")
    ax_a.set(title=f"held-out mean@8, {design.ENDPOINT_SET} first 64 (%)", xlabel="step", ylim=(0, 100))
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_xlim(-1, design.STEPS + 1)
    ax_p.legend(fontsize=7)
    ax_c.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return save_figure(fig, png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", default="studies/entropy/records/stage2")
    ap.add_argument("--out", default="studies/entropy/results-entropy-headline.png")
    args = ap.parse_args()
    print(draw(series(Path(args.records)), Path(args.out)))


if __name__ == "__main__":
    main()
