"""The claim test's design as overrides, from ``protocol.md`` (the rules were written there first): the
settings every run shares, each test's own (Test 2's pool and held-out set: amendments 3 and 5), the arms,
seeds and steps, and the runs' names. The runner
(``run``) and the report read it; nothing here starts a process.

    python -m studies.claim.design            # each test's runs and their overrides, one run a line
"""

from __future__ import annotations

from dataclasses import dataclass

# Common settings (protocol.md, "Common settings", with its amendment of 2026-12-02 evening: the
# template, temperature and precision). The model file sets tiny_arith with the boxed template and
# temperature 0.6; fp32 so that a 1e-5 step moves the weights the rollout sees from the first update.
COMMON = (
    "model=smollm2-135m",
    "trainer.prompts_per_step=8",
    "rollout.n=8",
    "rollout.max_tokens=256",
    "actor.lr=1e-5",
    "actor.bf16=false",
    "algorithm.kl_coef=0.001",
    "trainer.reward.overlong_buffer=64",
    "trainer.reward.overlong_penalty=1.0",
    # in-run measurement: the fixed-text probe every 5 steps and before the first; the held-out
    # evaluation's steps and size are each test's (an evaluation of 200 x 8 took 486 s at step 0)
    "probe.every=5",
    "probe.limit=64",
    "probe.n=2",
    "trainer.eval_before_train=true",
    "eval.n=8",
    # a checkpoint only to resume an interrupted run; no result reads it
    "trainer.save_every=5",
    "trainer.keep_last=1",
    "trainer.export_hf=false",
    "trainer.wandb.mode=disabled",
)

BAND = ("algorithm=bandpo", "algorithm.band.divergence=kl", "algorithm.band.delta=0.05")
ALGORITHMS = {
    "grpo": ("algorithm=grpo",),
    "clip_higher": ("algorithm=clip_higher",),
    "bandpo": BAND,
    "no_clip": ("algorithm=no_clip",),
    "clip_cov": ("algorithm=clip_cov",),
    "kl_cov": ("algorithm=kl_cov",),
}


@dataclass(frozen=True)
class HeldOut:
    """A held-out set the runner writes as JSONL before a test's runs: ``size`` problems of tiny_arith's
    ``test`` split (no canonical key shared with a training problem) at one level and set of kinds."""

    name: str  # the file's stem, so the set's name in the records: eval/<name>/mean@8
    difficulty: int
    kinds: tuple[str, ...]
    size: int = 200

    def rows(self) -> list[dict]:
        from bandpo.data.tiny_arith_problems import make_split

        return make_split("test", self.size, 0, difficulty=self.difficulty, kinds=self.kinds)


@dataclass(frozen=True)
class Test:
    name: str
    settings: tuple[str, ...]  # the test's own overrides, after COMMON
    arms: tuple[str, ...]  # primary arms, in the order each seed runs them
    secondary: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    heldout: HeldOut | None = None  # None: the model file's held-out set (tiny_arith_test)


# Test 1: each clip's own effect on entropy under random rewards; 4 mini-batches x 2 epochs = 8
# optimizer steps per rollout so that the ratios move.
RANDOM = Test(
    name="random",
    settings=(
        "trainer.reward.random_p=0.5",
        "trainer.eval_every=20",  # held-out accuracy at steps 0 and 20 only: descriptive in this test
        "eval.limit=64",
        "actor.mini_batch_prompts=2",
        "actor.epochs=2",
        "trainer.total_steps=20",
    ),
    arms=("grpo", "no_clip", "bandpo", "clip_higher"),
    secondary=("clip_cov", "kl_cov"),
    seeds=(0, 1, 2, 3, 4),
    steps=20,
)

# Test 2: GRPO against BandPO on a pool GRPO cannot exhaust. Amendment 5 (after the first pilot failed the
# gate low on level-2 one-operation problems alone): all of level 1's one-operation training problems beside
# 192 level-2 ones, 320 rows = 40 steps x 8 prompts, each drawn once. The model file's 2 optimizer steps a
# rollout; the held-out set (and the probe's prompts) level-2 one-operation problems of the test split.
ONE_OP = ("add", "sub", "mul")
LEARN_POOL = HeldOut(name="tiny_arith_l2_one_op_test", difficulty=2, kinds=ONE_OP)


@dataclass(frozen=True)
class TrainEntry:
    """One ``data.train`` entry: ``size`` tiny_arith training-split problems at one level and set of kinds."""

    difficulty: int
    kinds: tuple[str, ...]
    size: int

    def override(self) -> str:
        kinds = ",".join(self.kinds)
        return (
            f"{{name:tiny_arith,split:train,size:{self.size},difficulty:{self.difficulty},kinds:[{kinds}]}}"
        )


# level 1 holds 131 distinct one-operation training problems (make_split refuses more); 128 taken
LEARN_TRAIN = (TrainEntry(2, ONE_OP, 192), TrainEntry(1, ONE_OP, 128))
LEARN = Test(
    name="learn",
    settings=(
        f"data.train=[{','.join(e.override() for e in LEARN_TRAIN)}]",
        "trainer.eval_every=40",
        "eval.limit=200",
        "trainer.total_steps=40",
    ),
    arms=("grpo", "bandpo"),
    secondary=(),
    seeds=(0, 1, 2, 3, 4),
    steps=40,
    heldout=LEARN_POOL,
)

TESTS = {t.name: t for t in (RANDOM, LEARN)}


def test(name: str) -> Test:
    if name not in TESTS:
        raise SystemExit(f"unknown test {name!r}; valid: {', '.join(sorted(TESTS))}")
    return TESTS[name]


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def overrides(t: Test, arm: str, seed: int, heldout_file: str | None = None) -> list[str]:
    """One run's Hydra overrides: the common settings, the test's, the arm's, the seed; with a held-out
    set of the test's own, the file the runner wrote it to (the probe reads the same set)."""
    if arm not in ALGORITHMS:
        raise SystemExit(f"unknown arm {arm!r}; valid: {', '.join(ALGORITHMS)}")
    own = []
    if t.heldout is not None:
        if heldout_file is None:
            raise ValueError(f"test {t.name!r} evaluates on its own held-out set: give its file")
        # a file named in eval.datasets is read as a set named after its stem (the probe follows eval's sets)
        own = [f"eval.datasets=[{heldout_file}]"]
    return [*COMMON, *t.settings, *own, *ALGORITHMS[arm], f"trainer.seed={seed}"]


def plan(
    t: Test, arms: tuple[str, ...] | None = None, seeds: tuple[int, ...] | None = None
) -> list[tuple[str, int]]:
    """The runs in order: seed by seed, every arm of a seed before the next seed (pairs finish first)."""
    return [(arm, seed) for seed in (seeds or t.seeds) for arm in (arms or t.arms)]


if __name__ == "__main__":
    for t in TESTS.values():
        file = None if t.heldout is None else f"<runs>/{t.name}/{t.heldout.name}.jsonl"
        for arm, seed in plan(t, t.arms + t.secondary):
            print(t.name, run_name(arm, seed), " ".join(overrides(t, arm, seed, file)))
