"""The actor's forward passes: per-token log-probs and entropy of response tokens, batched by
tokens, for the old and reference log-probs (``compute_logprobs``, no gradient) and for the
update's micro-batches (``_forward``, with gradient).

``ActorForward`` is a base of ``bandpo.actor.worker.Actor`` and reads the actor's attributes:
``engine`` and ``ref`` (DeepSpeed engines), ``lora``, ``device``, ``temperature``, ``padding_free``,
``share_prompts``, ``logits_chunk_tokens``, ``logprob_token_budget``, ``zero_stage``,
``world_size``. Padding-free (the default) packs rows into one sequence and runs the chunked lm_head
(``bandpo.actor.packing``, ``bandpo.actor.chunked``); ``padding_free=False`` is the padded
reference path with full float32 logits. Under ZeRO-3 every forward is collective.
"""

from __future__ import annotations

import torch

from bandpo.actor.logprobs import (
    budget_chunks,
    check_padding,
    packed_logprobs,
    response_logits,
    token_entropy,
    token_logprobs,
    trim_padding,
)
from bandpo.actor.lora import reference_mode
from bandpo.actor.packing import pack_rows, packed_budget_groups, prompt_keys
from bandpo.types import TrainBatch


class ActorForward:
    """Log-probs and entropy of one actor rank (see the module docstring)."""

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, with_entropy: bool = False, ref: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [N, R] (and entropy [N, R] when asked) of the response tokens, float32 on CPU.

        ``ref=True`` uses the frozen reference model (with LoRA: this model with its adapters off,
        ``bandpo.actor.lora.reference_mode``). Rows are grouped into forward passes of
        at most ``logprob_token_budget`` tokens (packed; padded ones with ``padding_free=False``);
        padding positions hold 0.0.
        """
        model = self._model(ref)
        model.eval()
        with reference_mode(model, active=ref):
            return self._compute_logprobs(model, batch, with_entropy)

    def _compute_logprobs(self, model, batch: TrainBatch, with_entropy: bool):
        check_padding(batch.prompt_mask, batch.response_mask)
        if not isinstance(batch, TrainBatch):
            batch = TrainBatch.from_rollout(batch)
        n, width = batch.response_ids.shape
        logprobs = torch.zeros(n, width, dtype=torch.float32)
        entropy = torch.zeros(n, width, dtype=torch.float32) if with_entropy else None
        p_lens, r_lens = batch.prompt_mask.sum(-1).tolist(), batch.response_mask.sum(-1).tolist()
        if self.padding_free:
            chunks = packed_budget_groups(p_lens, r_lens, self.logprob_token_budget, self._prompt_keys(batch))
        else:
            chunks = budget_chunks(p_lens, r_lens, self.logprob_token_budget)
        for idx in chunks:
            rows = torch.tensor(idx)
            lp, ent, r_mask = self._forward(model, batch.select(rows), with_entropy=with_entropy)
            r = r_mask.shape[1]
            logprobs[rows, :r] = lp.cpu()
            if entropy is not None:
                entropy[rows, :r] = ent.cpu()
        self._pad_zero3_passes(model, len(chunks))
        self._release_cache()
        return logprobs, entropy

    def _forward(self, model, mb: TrainBatch, *, with_entropy: bool = True, entropy_grad: bool = False):
        """``(logprobs [n, r], entropy [n, r] or None, response_mask [n, r])`` on the device for
        the rows of ``mb``, r its longest response; 0.0 at padding. Grad flows when enabled."""
        if self.padding_free:
            packed = pack_rows(
                mb.prompt_ids,
                mb.prompt_mask,
                mb.response_ids,
                mb.response_mask,
                share_prompts=self.share_prompts,
            ).to(self.device)
            lp, ent = packed_logprobs(
                model,
                packed,
                temperature=self.temperature,
                chunk=self.logits_chunk_tokens,
                head=self.logprob_head,
                fp32_head=self.fp32_head,
                entropy_grad=entropy_grad,
            )
            return lp, ent, packed.response_mask.long()
        p_ids, p_mask, r_ids, r_mask = (
            t.to(self.device)
            for t in trim_padding(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask)
        )
        logits = response_logits(model, p_ids, p_mask, r_ids, r_mask, temperature=self.temperature)
        pad = r_mask == 0
        logprobs = token_logprobs(logits, r_ids).masked_fill(pad, 0.0)  # [n, r]
        entropy = None
        if entropy_grad:
            entropy = token_entropy(logits).masked_fill(pad, 0.0)
        elif with_entropy:  # for the metric only: no graph through a second softmax
            with torch.no_grad():
                entropy = token_entropy(logits.detach()).masked_fill(pad, 0.0)
        return logprobs, entropy, r_mask

    def _prompt_keys(self, batch: TrainBatch) -> list | None:
        """Per-row prompt keys for grouping rows that share a prompt, or None when prompts are not shared."""
        return prompt_keys(batch.prompt_ids, batch.prompt_mask) if self.share_prompts else None

    def _model(self, ref: bool):
        if not ref or self.lora is not None:  # LoRA: the reference is the engine with its adapters off
            return self.engine
        if self.ref is None:
            raise ValueError("compute_logprobs(ref=True) needs an Actor built with ref_model=True")
        return self.ref

    def _pad_zero3_passes(self, model, done: int) -> None:
        """Under ZeRO-3 every forward is a collective (parameter gathers): ranks with fewer
        chunks than the busiest rank run dummy one-token forwards to keep in step."""
        if self.zero_stage != 3 or self.world_size == 1:
            return
        most = self._all_reduce(torch.tensor([done]), max_=True)
        one = torch.ones(1, 1, dtype=torch.long, device=self.device)
        for _ in range(int(most) - done):
            model(input_ids=one, attention_mask=one, use_cache=False, logits_to_keep=1)
