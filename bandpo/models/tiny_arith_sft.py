"""The tiny-arith warm start and its held-out check (``bandpo.models.tiny_arith`` builds the model).

The prompt is the DAPO template through the chat template (``prompt_text``); the warm start
trains on prompt -> solution pairs with the loss on the solution only
(``supervised_warm_start``), optionally stopping when a check on a fixed set first passes;
``shared_prefix_loss`` is that loss computed once over the prompt prefix every row of a batch
shares (the chat template and the instruction: 43 of ~75 prompt tokens), the same number as the
whole-sequence loss (``sequence_loss``, its reference) in ~55% of the compute;
``expected_accuracy`` is that check: the probability that one sample at temperature 1 writes the
reference solution, averaged over the set (no sampling, so no sampling noise); ``sample_accuracy``
samples one answer per problem and counts exact matches on the last "Answer:" line.
"""

from __future__ import annotations

import math
import re

# The DAPO prompt of the paper (DAPO's answer-line format); the rollout side must use the same text.
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    '{problem}\n\nRemember to put your answer on its own line after "Answer:".'
)


def prompt_text(tok, problem: str) -> str:
    """The rendered prompt (DAPO template through the chat template, generation prompt on)."""
    messages = [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_pairs(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for r in rows:
        prompt = tok(prompt_text(tok, r["problem"]), add_special_tokens=False)["input_ids"]
        completion = tok(r["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pairs.append((prompt, completion))
    return pairs


def supervised_warm_start(model, tok, rows: list[dict], args, log, stop=None) -> tuple[float, int]:
    """AdamW on prompt -> solution pairs, loss on solution tokens only.

    ``args`` is the build's ``bandpo.models.tiny_arith.BuildArgs`` (steps, batch size, lr, seed,
    ``check_every``). ``stop(step) -> bool``, when given, is called every ``args.check_every`` steps
    (model in eval mode) and ends the warm start when it returns True; the learning-rate schedule
    stays the one of ``args.sft_steps`` steps either way. With ``stop``, a schedule that ends before
    it returns True goes on at its final learning rate for up to ``args.extra_steps`` more steps,
    checked as before: the same arguments reach the target after anything from ~1,400 to over 2,000
    steps depending on the kernels' rounding, so a fixed end would leave some builds short of it.
    ``args.max_steps`` (None: no limit) ends it after that many steps whatever the rest says.
    Returns (the last loss's moving average, the steps taken)."""
    import torch

    if args.sft_steps <= 0:
        return float("nan"), 0
    pairs = encode_pairs(tok, rows)
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        frac = min(1.0, (step - args.warmup_steps) / max(1, args.sft_steps - args.warmup_steps))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))  # the extra steps stay at the end's 0.1

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    ema = None
    total = args.sft_steps + (args.extra_steps if stop is not None else 0)
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    for step in range(total):
        idx = torch.randint(len(pairs), (args.batch_size,), generator=gen).tolist()
        loss = shared_prefix_loss(model, [pairs[i] for i in idx], tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if (step + 1) % 50 == 0 or step + 1 == total:
            log(f"  sft step {step + 1}/{args.sft_steps}  loss {ema:.3f}")
        if stop is not None and (step + 1) % args.check_every == 0:
            model.eval()
            if stop(step + 1):
                return float(ema), step + 1
            model.train()
    model.eval()
    return float(ema), total


def sequence_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int):
    """Mean cross-entropy over the completion tokens of ``batch`` (prompt, completion) pairs, each
    sequence run whole: the reference ``shared_prefix_loss`` is checked against."""
    input_ids, labels, attn = _collate(batch, pad_id)
    return model(input_ids=input_ids, attention_mask=attn, labels=labels).loss


def shared_prefix_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int):
    """``sequence_loss``, with the prompt prefix all rows share run once.

    Causal attention makes a shared prefix's keys and values the same in every row, so the prefix
    runs as one sequence and its cache is broadcast to the batch (its gradient sums over the rows,
    as the rows' own prefix copies would); the rest of each row attends to it. The output head runs
    only where a completion token is predicted (the loss never reads the other positions). Same
    math as ``sequence_loss``; only the order of float additions differs.
    """
    import torch
    from transformers import DynamicCache

    first = batch[0][0]
    # the longest common prefix of the prompts, less one token: every row keeps a prompt token after
    # it, which predicts the completion's first token
    k = min(len(p) for p, _ in batch) - 1
    for p, _ in batch[1:]:
        k = next((i for i in range(k) if p[i] != first[i]), k)
    if k < 1:
        return sequence_loss(model, batch, pad_id)
    rows = len(batch)
    prefix = model.model(input_ids=torch.tensor([first[:k]]), use_cache=True).past_key_values
    cache = DynamicCache(
        ddp_cache_data=[
            (layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
            for layer in prefix.layers
        ]
    )
    input_ids, labels, attn = _collate([(p[k:], c) for p, c in batch], pad_id)  # [B, W] each
    width = input_ids.shape[1]
    hidden = model.model(
        input_ids=input_ids,
        attention_mask=torch.cat([torch.ones(rows, k, dtype=attn.dtype), attn], dim=1),  # [B, k + W]
        position_ids=torch.arange(k, k + width).expand(rows, -1),  # [B, W]
        past_key_values=cache,
    ).last_hidden_state  # [B, W, H]
    target = labels[:, 1:]  # [B, W-1]: position t predicts token t+1
    keep = target >= 0
    logits = model.lm_head(hidden[:, :-1][keep])  # [N, V]: only where a completion token is predicted
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


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


def expected_accuracy(model, tok, pairs: list[tuple[list[int], list[int]]], batch_size: int = 100) -> float:
    """Mean over ``pairs`` (``encode_pairs``) of the probability that one sample at temperature 1
    writes exactly the reference solution: prod_t p(y_t | x, y_<t) over the solution and its closing
    token. Every tiny-arith solution has one canonical form, so this is T=1 accuracy up to the rare
    sample that reaches the right answer another way (a lower bound; on a 1,500-step build: 0.761
    expected against 0.760 sampled), computed in one forward pass per batch and free of sampling noise."""
    import torch

    total = 0.0
    for start in range(0, len(pairs), batch_size):
        input_ids, labels, attn = _collate(pairs[start : start + batch_size], tok.pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        target = labels[:, 1:]  # [N, W-1]: token t+1 is predicted at position t
        logp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total += (logp * (target >= 0)).sum(dim=-1).exp().sum().item()
    return total / max(1, len(pairs))


def last_answer(text: str) -> str | None:
    """The value on the last "Answer:" line of ``text`` (None if there is none)."""
    found = re.findall(r"Answer:\s*(\S+)", text)
    return found[-1].strip().rstrip(".") if found else None


def sample_accuracy(
    model,
    tok,
    rows: list[dict],
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    batch_size: int = 100,
    seed: int = 0,
) -> float:
    """Fraction of ``rows`` answered exactly (one sample each; temperature 0 = greedy)."""
    import torch

    torch.manual_seed(seed)
    correct = 0
    tok.padding_side = "left"  # generation continues from the right end of every row
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        enc = tok(
            [prompt_text(tok, r["problem"]) for r in chunk],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        sampling = (
            dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            if temperature > 0
            else dict(do_sample=False)
        )
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                **sampling,
            )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(last_answer(t) == r["answer"] for t, r in zip(texts, chunk))
    return correct / max(1, len(rows))
