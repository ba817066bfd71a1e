"""One measurement of ``benchmarks/actor.py --compare`` (its docstring describes the mode): one
in-process rank, one path (padding-free or padded), one cap R, on long-tailed response lengths.
``benchmarks.actor`` runs it as ``--single`` in a fresh subprocess per measurement and prints the table."""

from __future__ import annotations

import tempfile

from benchmarks.common import build_model, matmul_peak, peak_fractions, resolved_bf16, rss_bytes, timed_peak


def long_tailed_batch(rows: int, prompt_len: int, max_response: int, vocab: int, seed: int, group: int = 1):
    """Prompts of prompt_len/2 .. prompt_len tokens, responses lognormal (median max/8, sigma 1)
    capped at max_response, the first row at the cap (the longest row sets the padded width);
    ``group`` consecutive rows answer the same prompt."""
    import numpy as np
    import torch

    from bandpo.types import RolloutBatch, TrainBatch

    rng = np.random.default_rng(seed)
    r_lens = np.clip(np.round(rng.lognormal(np.log(max_response / 8), 1.0, rows)), 1, max_response).astype(
        int
    )
    r_lens[0] = max_response
    if rows % group:
        raise SystemExit(f"--rows {rows} is not a multiple of --group-size {group}")
    p_lens = rng.integers(prompt_len // 2, prompt_len + 1, rows // group)
    g = torch.Generator().manual_seed(seed)
    prompts = [p for n in p_lens for p in [torch.randint(3, vocab, (int(n),), generator=g).tolist()] * group]
    responses = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in r_lens]
    rb = RolloutBatch.from_lists(
        prompts, responses, [[0.0] * len(r) for r in responses], list(range(rows)), ["stop"] * rows, pad_id=0
    )
    return TrainBatch.from_rollout(rb, advantages=torch.randn(rows, generator=g))


def processed_tokens(batch, actor, update: bool) -> int:
    """Tokens the forward passes see, padding included and shared prompts counted once per pass, as
    the actor groups this batch."""
    import torch

    from bandpo.actor.logprobs import budget_chunks
    from bandpo.actor.packing import pack_rows, packed_budget_groups, prompt_keys

    p = batch.prompt_mask.sum(-1).tolist()
    r = batch.response_mask.sum(-1).tolist()
    if actor.padding_free:  # the passes as the actor groups and packs them
        keys = prompt_keys(batch.prompt_ids, batch.prompt_mask) if actor.share_prompts else None
        budget = actor.max_tokens_per_micro_batch if update else actor.logprob_token_budget
        passes = [batch.select(torch.tensor(g)) for g in packed_budget_groups(p, r, budget, keys)]
        return sum(
            pack_rows(
                mb.prompt_ids,
                mb.prompt_mask,
                mb.response_ids,
                mb.response_mask,
                share_prompts=actor.share_prompts,
            ).input_ids.shape[1]
            for mb in passes
        )
    if update:
        step = actor.micro_batch_size
        groups = [list(range(i, min(i + step, len(p)))) for i in range(0, len(p), step)]
    else:
        groups = budget_chunks(p, r, actor.logprob_token_budget)
    return sum(len(g) * (max(p[i] for i in g) + max(max(r[i] for i in g), 1)) for g in groups)


def single(args) -> dict:
    """One in-process rank, one path, one R: the numbers of ``--compare``."""
    import torch

    from bandpo.actor import Actor
    from bandpo.algo.options import LossOptions

    loss_options = LossOptions(algorithm="bandpo", agg="seq-mean-token-mean")
    bf16 = resolved_bf16(args.bf16)
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(
            tmp,
            args.hidden,
            args.layers,
            args.intermediate,
            args.vocab,
            args.kv_heads,
            args.prompt_len + args.max_response + 1,
        )
        actor = Actor(
            tmp,
            mini_batch_size=args.rows,
            micro_batch_size=args.micro,
            lr=1e-6,
            bf16=bf16,
            padding_free=not args.old_path,
            max_tokens_per_micro_batch=0 if args.old_path else args.max_tokens,
            logprob_token_budget=args.logprob_budget,
            logits_chunk_tokens=args.chunk,
            share_prompts=not args.no_share,
        )
    batch = long_tailed_batch(
        args.rows, args.prompt_len, args.max_response, args.vocab, seed=0, group=args.group_size
    )
    warm = long_tailed_batch(args.rows, 4, 4, args.vocab, seed=1)  # creates the optimizer state
    warm.old_logprobs = actor.compute_logprobs(warm)[0]
    actor.update(warm, loss_options)
    base = rss_bytes()
    out = {}
    lp_s, lp_peak = timed_peak(lambda: out.update(lp=actor.compute_logprobs(batch, with_entropy=True)))
    batch.old_logprobs = out["lp"][0]
    up_s, up_peak = timed_peak(lambda: actor.update(batch, loss_options))
    real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    update_run = processed_tokens(batch, actor, update=True)
    logprob_run = processed_tokens(batch, actor, update=False)
    peak = matmul_peak(
        args.hidden, args.intermediate, torch.bfloat16 if bf16 else torch.float32, actor.device
    )
    return {
        **peak_fractions(params, update_run, up_s, logprob_run, lp_s, peak["flops_per_s"]),
        "matmul_peak": peak,
        "path": "old" if args.old_path else "new" if actor.share_prompts or args.group_size == 1 else "unsh",
        "max_response": args.max_response,
        "real_tokens": real,
        "response_tokens": int(batch.response_mask.sum()),
        "logprob_extra_peak_gb": (lp_peak - base) / 2**30,
        "update_extra_peak_gb": (up_peak - base) / 2**30,
        "logprob_tok_s": real / lp_s,
        "update_tok_s": real / up_s,
        # padding: the share of processed tokens that are padding; run/rows: processed over the
        # rows' own tokens (below 1 when shared prompts run once per pass)
        "logprob_padding_frac": max(0.0, 1 - real / logprob_run),
        "update_padding_frac": max(0.0, 1 - real / update_run),
        "update_run_over_rows": update_run / real,
        "torch_threads": torch.get_num_threads(),
    }
