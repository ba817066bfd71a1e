"""Is a bf16 actor's update the fp32 one? The gradient of one optimizer step, both precisions, same batch.

    .venv/bin/python -m benchmarks.check_bf16_update [--model DIR] [--states 3] [--prompts 32] [--lr 1e-3]

From the same weights and the same rollout batch, one optimizer step of the real actor (DeepSpeed
ZeRO-2, BandPO's loss, the learning test's step by default: 32 prompts x 8 samples, 64-token cap,
lr 1e-3, one optimizer step a rollout) runs in fp32 and in bf16 (bf16 weights and activations, fp32 masters). The flat fp32 gradient AdamW
receives (after DeepSpeed's reduction and clipping) is captured from each and compared:

    cos(bf16, fp32)      cosine of the two gradients on the same batch: what precision changes
    cos(batch A, B)      cosine of the fp32 gradients of two batches sampled from the same policy:
                         what sampling changes, the floor any precision error is to be judged against
    sign agreement       share of entries with the same sign (Adam's first step is lr * sign(g))
    update cos           cosine of the two masters' moves (the step Adam took)

States: the starting weights, then the weights after each fp32 step (a trajectory of ``--states``).
Batches are sampled with transformers' ``generate`` at temperature 1 (the engine is not under test);
rewards are the learning test's task (every gold answer is "2"), advantages GRPO's per group.
Prints a row per state and writes JSON with the CPU's name and flags; nothing here is a timed
assertion. On a CPU without avx512_bf16 / amx_bf16 the bf16 step runs emulated (slow, same roundings).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from bandpo.actor import Actor
from bandpo.algo.advantages import compute_advantages
from bandpo.data.prompts import render_prompt
from bandpo.data.tiny_arith_problems import make_split
from bandpo.reward.verify import verify_one
from bandpo.types import RolloutBatch, TrainBatch

# The learning test's algorithm (configs/algorithm/bandpo.yaml, composed in main) and batch.
SAMPLES, MAX_TOKENS = 8, 64


def sample(
    model_dir: str, problems: list[str], tokenizer, seed: int, prompts: int
) -> tuple[RolloutBatch, torch.Tensor]:
    """``(batch, rewards [N])``: SAMPLES responses to each of ``prompts`` problems drawn with ``seed``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(problems), generator=g)[:prompts].tolist()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    prompts, responses, index, finish, rewards = [], [], [], [], []
    torch.manual_seed(seed)
    for j, i in enumerate(chosen):
        prompt = render_prompt(tokenizer, problems[i], "dapo")
        ids = torch.tensor([prompt] * SAMPLES)  # [G, P]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for row in out[:, len(prompt) :].tolist():
            stop = eos in row
            row = row[: row.index(eos) + 1] if stop else row
            status, _ = verify_one(tokenizer.decode(row, skip_special_tokens=True), "2", "dapo")
            prompts.append(prompt)
            responses.append(row)
            index.append(j)
            finish.append("stop" if stop else "length")
            rewards.append(1.0 if status == "correct" else -1.0)
    logprobs = [[0.0] * len(r) for r in responses]  # the rollout's own log-probs are not used here
    return RolloutBatch.from_lists(prompts, responses, logprobs, index, finish, pad_id=pad), torch.tensor(
        rewards
    )


def one_step(
    model_dir: str,
    bf16: bool,
    batch: RolloutBatch,
    rewards: torch.Tensor,
    lr: float,
    options,
    save: str | None = None,
):
    """One optimizer step from ``model_dir``: ``(grad, master before, master after)`` flat fp32, and the
    update's metrics; with ``save``, the fp32 weights after it are written there as an HF folder."""
    actor = Actor(
        model_dir,
        zero_stage=2,
        lr=lr,
        bf16=bf16,
        mini_batch_size=batch.size,
        micro_batch_size=batch.size // 2,
        ref_model=True,
        max_tokens_per_micro_batch=16384,
    )
    ref, _ = actor.compute_logprobs(batch, ref=True)
    adam = actor.engine.optimizer.optimizer  # the torch AdamW inside DeepSpeed's ZeRO optimizer
    seen: dict[str, torch.Tensor] = {}
    step = adam.step

    def capture(*args, **kwargs):
        params = [p for group in adam.param_groups for p in group["params"]]
        seen["grad"] = torch.cat([p.grad.detach().float().flatten() for p in params])
        seen["before"] = torch.cat([p.detach().float().flatten() for p in params])
        result = step(*args, **kwargs)
        seen["after"] = torch.cat([p.detach().float().flatten() for p in params])
        return result

    adam.step = capture
    advantages, _ = compute_advantages(rewards, SAMPLES)
    train = TrainBatch.from_rollout(batch, advantages=advantages, rewards=rewards, ref_logprobs=ref)
    metrics, _, _ = actor.update_on_policy(train, options)
    adam.step = step
    if save:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        weights = {name: t.float() for bucket in actor.named_weights() for name, t in bucket}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.load_state_dict(weights, strict=False)  # a tied lm_head comes with the embedding
        model.save_pretrained(save)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(save)
    actor.close()
    return seen, metrics


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def sign_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.sign() == b.sign()).float().mean())


def main() -> None:
    from transformers import AutoTokenizer

    from bandpo.config import compose
    from bandpo.config.algorithm import loss_options
    from bandpo.distributed.precision import cpu_has_fast_bf16, cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = Path(os.environ.get("BANDPO_CACHE", Path.home() / ".cache/bandpo")) / "tiny_arith/model-sft500"
    ap.add_argument("--model", default=str(default), help="an fp32 HF folder (default: the learning test's)")
    ap.add_argument("--states", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="prompts a step (x 8 samples)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="bf16_update.json")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    options = loss_options(compose(["algorithm=bandpo", f"rollout.max_tokens={MAX_TOKENS}"]))
    problems = [r["problem"] for r in make_split("train", 256, seed=7)]  # the learning test's prompts
    cpu = cpu_name()
    print(f"cpu {cpu}, native bf16 {cpu_has_fast_bf16()}, threads {torch.get_num_threads()}")
    rows, path, work = [], args.model, tempfile.mkdtemp(prefix="bf16-update-")
    for state in range(args.states):
        batch_a, rewards_a = sample(path, problems, tokenizer, 1000 + state, args.prompts)
        batch_b, rewards_b = sample(path, problems, tokenizer, 2000 + state, args.prompts)
        fp32_b, _ = one_step(path, False, batch_b, rewards_b, args.lr, options)
        bf16_a, m16 = one_step(path, True, batch_a, rewards_a, args.lr, options)
        nxt = os.path.join(work, f"state{state + 1}")
        fp32_a, m32 = one_step(path, False, batch_a, rewards_a, args.lr, options, save=nxt)
        move16, move32 = bf16_a["after"] - bf16_a["before"], fp32_a["after"] - fp32_a["before"]
        row = {
            "state": state,
            "accuracy": float((rewards_a > 0).float().mean()),
            "grad_norm_fp32": m32["grad_norm"],
            "grad_norm_bf16": m16["grad_norm"],
            "cos_bf16_fp32": cosine(bf16_a["grad"], fp32_a["grad"]),
            "cos_batch_a_b": cosine(fp32_a["grad"], fp32_b["grad"]),
            "sign_bf16_fp32": sign_agreement(bf16_a["grad"], fp32_a["grad"]),
            "sign_batch_a_b": sign_agreement(fp32_a["grad"], fp32_b["grad"]),
            "update_cos_bf16_fp32": cosine(move16, move32),
            "grad_rel_err_bf16": float((bf16_a["grad"] - fp32_a["grad"]).norm() / fp32_a["grad"].norm()),
            "masters_max_diff": float((bf16_a["before"] - fp32_a["before"]).abs().max()),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        path = nxt
    print("state  acc   cos(bf16,fp32)  cos(A,B)  sign(bf16,fp32)  sign(A,B)  update cos  rel err")
    for r in rows:
        print(
            f"{r['state']:5d}  {r['accuracy']:.2f}  {r['cos_bf16_fp32']:14.4f}  {r['cos_batch_a_b']:8.3f}  "
            f"{r['sign_bf16_fp32']:15.3f}  {r['sign_batch_a_b']:9.3f}  {r['update_cos_bf16_fp32']:10.4f}  "
            f"{r['grad_rel_err_bf16']:7.3f}"
        )
    Path(args.out).write_text(
        json.dumps({"cpu": cpu, "native_bf16": cpu_has_fast_bf16(), "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
