"""Stage 2's design, shared by the runs (``stage2``), the verdict (``verdict``) and the headline
figure (``figure``): the arms, seeds and steps, the probed and evaluated steps, the endpoint set, the
report's section and the runs' names. It sits below the three so that none of them imports another
for it."""

from __future__ import annotations

from studies.entropy.stage0 import ARMS  # grpo; bandpo with KL, delta 0.05

SEEDS = (0, 1, 2)
STEPS, EVERY, EVALS = 60, 5, (30, 60)
PROBED = range(EVERY, STEPS + 1, EVERY)  # each run's probed steps (step 0, the base model, is shared)
ENDPOINT_SET = "tiny_arith_test"
HEADING = "## Stage 2"


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def plan() -> list[tuple[str, int]]:
    """The runs in order: pairs by seed, GRPO first."""
    return [(arm, seed) for seed in SEEDS for arm in ARMS]
