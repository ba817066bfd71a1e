"""Helpers shared by the actor tests (unit and DeepSpeed ones), the eval-checkpoint, node-sync and GPU tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bandpo.actor import Actor
from bandpo.algo.options import LossOptions
from bandpo.types import RolloutBatch, TrainBatch

BANDPO = LossOptions(
    algorithm="bandpo", divergence="kl", delta=0.05, upper_cap=10.0, agg="seq-mean-token-mean"
)


def make_rollout(n: int, seed: int, *, max_prompt: int = 8, max_response: int = 12) -> RolloutBatch:
    """Random prompts/responses of random lengths (ids from the tiny tokenizer's range), pad id 0."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(
            3, 300, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g
        ).tolist()

    prompts = [ids(1, max_prompt) for _ in range(n)]
    responses = [ids(1, max_response) for _ in range(n)]
    return RolloutBatch.from_lists(
        prompts, responses, [[0.0] * len(r) for r in responses], list(range(n)), ["stop"] * n, pad_id=0
    )


def make_train_batch(actor: Actor, n: int, seed: int, *, noise: float = 0.3, advantages=None) -> TrainBatch:
    """A batch whose old logprobs are the actor's own, shifted by noise so that some ratios clip."""
    rb = make_rollout(n, seed)
    old, _ = actor.compute_logprobs(rb)
    g = torch.Generator().manual_seed(seed + 1)
    old = (old + noise * torch.randn(old.shape, generator=g)).clamp(max=-1e-3) * rb.response_mask
    adv = torch.randn(n, generator=g) if advantages is None else advantages
    return TrainBatch.from_rollout(rb, advantages=adv, old_logprobs=old, rewards=adv.sign())


def full_weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {name: t for bucket in actor.named_weights() for name, t in bucket}


def rank_weights(group) -> list[dict[str, torch.Tensor]]:
    """Every rank's full weights (``named_weights``) of an ``ActorGroup``, in rank order."""
    import ray

    # All ranks at once: under ZeRO-3 every bucket is a collective gather. The lambda names no
    # test-module globals, so Ray workers can unpickle it without importing this file.
    fetch = lambda actor: {name: t for bucket in actor.named_weights() for name, t in bucket}  # noqa: E731
    return ray.get([w.__ray_call__.remote(fetch) for w in group.workers])


# The update metrics a multi-rank run and one rank on the same batch must agree on.
COMPARED_METRICS = (
    "loss",
    "pg_loss",
    "entropy",
    "kl_ref",
    "approx_kl",
    "grad_norm",
    "num_tokens",
    "lr",
    "clip_frac_up",
    "clip_frac_down",
    "clip_frac_bin/lt0.01",
)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# Bounds for comparing the weights of two runs that did the same AdamW steps in a different
# fp32 summation order (micro-batching, ZeRO stage, ranks). A gradient entry is a sum of K
# per-token terms (here K <~ 16 rows x 12 tokens x 2 micro-batches ~ 400); reordering the sum
# moves it by about K * eps_fp32 * max|term| (eps_fp32 = 1.2e-7): ~5e-5 of the terms' size.
# AdamW's update is lr * m_hat / (sqrt(v_hat) + 1e-8), invariant to the gradient's scale, so:
# - an entry whose gradient is well above that noise moves by the same amount up to a relative
#   ~1e-4: far below DRIFT_OF_LR * lr;
# - an entry whose gradient is within the noise of zero (a handful of weights that almost no
#   token touches, or where terms cancel) can get any update in [-lr, lr] per step, so the
#   difference is bounded only by 2 * lr per optimizer step (a sign flip).
# Hence two checks: every entry within 2 * lr * steps (the hard bound), and at most
# MAX_DRIFTED_FRACTION of the entries beyond DRIFT_OF_LR * lr. A real bug (ranks not
# averaging, a rank's rows dropped or weighted differently, a wrong micro-batch split) changes
# the direction of the gradient and moves most entries by O(lr): it fails the second check.
# A wrongly *scaled* gradient (sum instead of mean) leaves Adam's update unchanged; the tests
# compare the pre-clip grad norm for that.
DRIFT_OF_LR = 0.01
MAX_DRIFTED_FRACTION = 0.01


def assert_same_adam_weights(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], lr: float, steps: int
) -> None:
    """``a`` and ``b`` are the same AdamW trajectory up to fp32 summation order (bounds above)."""
    assert a.keys() == b.keys()
    diffs = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in a])
    assert float(diffs.max()) <= 2 * lr * steps, (float(diffs.max()), 2 * lr * steps)
    drifted = float((diffs > DRIFT_OF_LR * lr).float().mean())
    assert drifted <= MAX_DRIFTED_FRACTION, (drifted, float(diffs.max()))


def masked_mean_per_row(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [N]
    return (x * mask).sum(-1) / mask.sum(-1)


def new_actor(model_dir, **kw) -> Actor:
    """Adam's first steps map a gradient g to about lr * g / (|g| + 1e-8): for entries with |g| near
    1e-8, fp32 summation-order noise (~1e-10) moves the update by ~1% of lr. Equivalence tests
    therefore use lr = 1e-4 (weights agree to ~1e-6) and also compare the pre-clip grad norm,
    which, unlike Adam's update, would expose a wrongly scaled loss. Precision: fp32 (``Actor``'s
    default, ``bf16=False``) on every machine unless a test passes ``bf16=True``; the tolerances of the
    tests that use it are fp32's, and the bf16 ones are derived where used (``bf16_logprob_bound``)."""
    kw = {"mini_batch_size": 8, "micro_batch_size": 2, "lr": 1e-4, "weight_decay": 0.0, **kw}
    return Actor(model_dir, **kw)


def plain_hf_logprobs(model_dir: str, rb: RolloutBatch) -> torch.Tensor:
    """One unpadded row at a time through a plain transformers model: [N, R], 0 at padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(rb.response_ids.shape)
    prompts, responses, _ = rb.to_lists()
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([p + r])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # predicts ids[1:]
            picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
            out[i, : len(r)] = picked[-len(r) :]
    return out


def run_cuda_check(script: str, model_dir: str, timeout: float = 600) -> dict:
    """Run ``script`` in a subprocess with ``DS_ACCELERATOR=cuda`` and return the JSON it prints after
    "RESULT ". conftest pins DeepSpeed's accelerator (a process-wide choice) to the CPU for every other
    test in this process, so a GPU actor needs a process of its own. The script gets the model folder
    as ``sys.argv[1]``; it runs in the repository root, which ``python -c`` puts on its path (for
    ``tests.helpers`` imports)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", script, model_dir],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "DS_ACCELERATOR": "cuda"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


# bf16 vs fp32 log-probs of one network: the bound's terms, derived in tests/unit/actor/test_bf16_logprobs.py.
U_BF16 = 2.0**-8  # bf16's unit roundoff: 8 significand bits, round to nearest
BF16_ROUNDINGS_PER_LAYER = 24
BF16_ROUNDINGS_OUTSIDE_LAYERS = 5
BF16_SIGMAS = 6


def bf16_logprob_bound(model_dir: str, rb: RolloutBatch) -> tuple[float, dict]:
    """``(bound, its terms)`` on max |log p_bf16 - log p_fp32| over ``rb``'s tokens for the model in ``model_dir``:
    2 u (max|z| + 6 sqrt(n / 3) m2), with z the fp32 logits, m2 = max_k ||h * w_k||_2 (h the last hidden state
    after the final norm, w_k the lm_head's row k) and n = 24 L + 5 bf16 roundings on the way to h."""
    import math

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weight = model.get_output_embeddings().weight  # [V, H]
    max_z = m2 = 0.0
    prompts, responses, _ = rb.to_lists()
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            # h: [T, H]
            h = model(input_ids=torch.tensor([p + r]), output_hidden_states=True).hidden_states[-1][0]
            max_z = max(max_z, float((h @ weight.t()).abs().max()))
            m2 = max(m2, float((h.square() @ weight.square().t()).sqrt().max()))
    n = BF16_ROUNDINGS_PER_LAYER * model.config.num_hidden_layers + BF16_ROUNDINGS_OUTSIDE_LAYERS
    bound = 2 * U_BF16 * (max_z + BF16_SIGMAS * math.sqrt(n / 3) * m2)
    return bound, {"max_z": max_z, "m2": m2, "n": n}
