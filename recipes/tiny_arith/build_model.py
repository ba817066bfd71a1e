"""Build the tiny-arith policy: tokenizer, Qwen2 model and a short supervised warm start.

    python recipes/tiny_arith/build_model.py --out runs/tiny_arith/model

Steps (all on CPU, a few minutes on 2 cores):
1. A byte-level BPE tokenizer trained on the task's text and the DAPO prompt, with the
   digits removed from that corpus so that no merge contains a digit: every number is
   spelled one digit per token, which small models find far easier to add.
2. A random Qwen2-architecture model (``bandpo.models.tiny``; heads 64 wide for vLLM CPU).
3. Supervised warm start on (prompt, solution) pairs of the train split: the prompt is
   the DAPO template through the chat template, the loss covers only the solution and
   the closing ``<|im_end|>``. ``sft_steps`` sets where RL starts: the default 500 steps
   leave ~20% held-out accuracy (the e2e tests' model); the recipe's config
   (configs/model/tiny.yaml, ``model.build_args``) takes 1,500 (~76%), from which RL's
   held-out gain is measurable (recipes/tiny_arith/default.md).
4. A quick held-out check: one sample per problem at temperature 1.0 (and greedy) with
   transformers ``generate``, exact match on the last "Answer:" line. Printed and stored.

The folder is an ordinary Hugging Face model folder. ``bandpo_tiny_arith.json`` records
the build arguments' hash: a second call with the same arguments returns at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script from a clone without `pip install -e`
    sys.path.insert(0, str(_REPO))

from bandpo.data.tiny_arith import DEFAULT_DIFFICULTY, make_split  # noqa: E402
from bandpo.models.tiny import build_tiny_model  # noqa: E402

# The DAPO prompt of the paper (DAPO's answer-line format); the rollout side must use the same text.
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\nRemember to put your answer on its own line after \"Answer:\"."
)
MARKER = "bandpo_tiny_arith.json"
# Bump when the build procedure changes, so cached folders from older code are rebuilt.
BUILD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BuildArgs:
    """Everything that determines the built model (hashed into the cache marker)."""

    seed: int = 0
    difficulty: int = DEFAULT_DIFFICULTY
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 512
    vocab_size: int = 512
    sft_steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    n_sft: int = 2500
    n_eval: int = 200


def build(out_dir: str | Path, seed: int = 0, sft_steps: int = BuildArgs.sft_steps, *, verbose: bool = True, **overrides) -> Path:
    """Build (or reuse) the tiny-arith model folder at ``out_dir`` and return its path.

    Args:
        out_dir: target folder; created, or replaced if it holds an older tiny-arith build.
        seed: seed for data, initialisation, batching and the accuracy check.
        sft_steps: optimizer steps of the warm start (0 leaves the model random).
        verbose: print progress and the held-out accuracy.
        **overrides: any other ``BuildArgs`` field (model size, lr, batch_size, ...).

    Returns:
        ``Path(out_dir)``, a Hugging Face folder (config, model.safetensors, tokenizer,
        chat template) plus the marker with the arguments and the held-out accuracy.
    """
    args = BuildArgs(seed=seed, sft_steps=sft_steps, **overrides)
    out = Path(out_dir)
    digest = _args_hash(args)
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("hash") == digest:
        return out
    if out.exists() and any(out.iterdir()) and not marker.exists():
        raise FileExistsError(f"{out} exists and is not a tiny-arith model folder; choose another --out")
    log = print if verbose else (lambda *a, **k: None)
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and move it in at the end: an interrupted build never
    # leaves a folder that looks finished.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        report = _build_into(tmp, args, log)
        report["build_seconds"] = round(time.time() - t0, 1)
        (tmp / MARKER).write_text(json.dumps({"hash": digest, "args": dataclasses.asdict(args),
                                              "version": BUILD_VERSION, "report": report}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log(f"built {out} in {report['build_seconds']:.0f}s: held-out accuracy "
        f"{report['acc_t1']:.1%} at temperature 1.0, {report['acc_greedy']:.1%} greedy "
        f"({args.n_eval} problems)")
    return out


def _args_hash(args: BuildArgs) -> str:
    blob = json.dumps({"version": BUILD_VERSION, **dataclasses.asdict(args)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _build_into(path: Path, args: BuildArgs, log) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save/load bars would bury the build's own lines
    train = make_split("train", args.n_sft, args.seed, difficulty=args.difficulty)
    held_out = make_split("test", args.n_eval, args.seed, difficulty=args.difficulty)
    build_tiny_model(
        path, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
        corpus=tokenizer_corpus(train), vocab_size=args.vocab_size, seed=args.seed,
    )
    (path / "bandpo_tiny.json").unlink()  # that marker describes the random init, not this model
    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tiny_arith: vocab {len(tok)}, {n_params / 1e6:.2f}M parameters; warm start {args.sft_steps} steps "
        f"x {args.batch_size} on {len(train)} train problems (difficulty {args.difficulty})")
    t0 = time.time()
    final_loss = supervised_warm_start(model, tok, train, args, log)
    sft_seconds = time.time() - t0
    model.save_pretrained(path, safe_serialization=True)
    acc_t1 = sample_accuracy(model, tok, held_out, temperature=1.0, seed=args.seed)
    acc_greedy = sample_accuracy(model, tok, held_out, temperature=0.0, seed=args.seed)
    return dict(n_params=n_params, vocab=len(tok), sft_loss=round(final_loss, 4), sft_seconds=round(sft_seconds, 1),
                acc_t1=acc_t1, acc_greedy=acc_greedy)


def tokenizer_corpus(rows: list[dict]) -> list[str]:
    """Texts for the BPE merges: the prompt template and task texts, with digits removed."""
    texts = [DAPO_TEMPLATE.format(problem=r["problem"]) + "\n" + r["solution"] for r in rows[:2000]]
    return [re.sub(r" +", " ", re.sub(r"[0-9]", "", t)) for t in texts] + ["user\nassistant\nsystem\n"]


def prompt_text(tok, problem: str) -> str:
    """The rendered prompt (DAPO template through the chat template, generation prompt on)."""
    messages = [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _encode_pairs(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for r in rows:
        prompt = tok(prompt_text(tok, r["problem"]), add_special_tokens=False)["input_ids"]
        completion = tok(r["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pairs.append((prompt, completion))
    return pairs


def supervised_warm_start(model, tok, rows: list[dict], args: BuildArgs, log) -> float:
    """AdamW on prompt -> solution pairs, loss on solution tokens only; returns the last loss."""
    import torch

    if args.sft_steps <= 0:
        return float("nan")
    pairs = _encode_pairs(tok, rows)
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        frac = (step - args.warmup_steps) / max(1, args.sft_steps - args.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    ema = None
    for step in range(args.sft_steps):
        idx = torch.randint(len(pairs), (args.batch_size,), generator=gen).tolist()
        input_ids, labels, attn = _collate([pairs[i] for i in idx], tok.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if (step + 1) % 50 == 0 or step + 1 == args.sft_steps:
            log(f"  sft step {step + 1}/{args.sft_steps}  loss {ema:.3f}")
    model.eval()
    return float(ema)


def _collate(batch, pad_id: int):
    import torch

    width = max(len(p) + len(c) for p, c in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (p, c) in enumerate(batch):
        seq = p + c
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(c)
        attn[i, : len(seq)] = 1
    return input_ids, labels, attn


def last_answer(text: str) -> str | None:
    """The value on the last "Answer:" line of ``text`` (None if there is none)."""
    found = re.findall(r"Answer:\s*(\S+)", text)
    return found[-1].strip().rstrip(".") if found else None


def sample_accuracy(model, tok, rows: list[dict], *, temperature: float = 1.0, max_new_tokens: int = 48,
                    batch_size: int = 100, seed: int = 0) -> float:
    """Fraction of ``rows`` answered exactly (one sample each; temperature 0 = greedy)."""
    import torch

    torch.manual_seed(seed)
    correct = 0
    tok.padding_side = "left"  # generation continues from the right end of every row
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        enc = tok([prompt_text(tok, r["problem"]) for r in chunk], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else \
            dict(do_sample=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id, **sampling)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(last_answer(t) == r["answer"] for t, r in zip(texts, chunk))
    return correct / max(1, len(rows))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="model folder to create (or reuse)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=BuildArgs.sft_steps)
    parser.add_argument("--difficulty", type=int, default=BuildArgs.difficulty)
    parser.add_argument("--quiet", action="store_true")
    ns = parser.parse_args(argv)
    out = build(ns.out, seed=ns.seed, sft_steps=ns.sft_steps, difficulty=ns.difficulty, verbose=not ns.quiet)
    report = json.loads((out / MARKER).read_text())["report"]
    print(f"tiny_arith model: {out}  (held-out acc {report['acc_t1']:.1%} @ T=1.0, "
          f"{report['acc_greedy']:.1%} greedy)")
    return out


if __name__ == "__main__":
    main()
