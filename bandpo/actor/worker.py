"""The actor: one DeepSpeed rank training a Hugging Face causal LM with the policy loss.

Shapes follow ``bandpo.types``: N rows (this rank's shard), P prompt columns (left-padded),
R response columns (right-padded), V vocabulary.

Data parallelism: n ``Actor`` objects (usually Ray actors, see ``bandpo.actor.group``) join
one torch.distributed group (gloo on CPU, nccl on GPU). Each holds a shard of every batch.
Losses are normalised by the counts of the *global* optimizer mini-batch (all micro-batches
of all ranks), so the summed micro-batch losses of all ranks are exactly the mini-batch loss.
DeepSpeed averages gradients over ranks, hence each rank back-propagates
``world_size * loss`` to end with the gradient of the sum.

Padding-free (default, ``padding_free=True``): each forward packs its rows into one sequence
(``bandpo.actor.packing``) and computes log-probs/entropy through the chunked lm_head
(``bandpo.actor.chunked``), so memory is bounded by tokens, never by rows x longest row x V;
attention stays within each row (``bandpo.actor.attention``: one causal SDPA call per bucket of
similar-length rows), never over a [T, T] mask.
Update micro-batches are grouped by ``max_tokens_per_micro_batch`` packed tokens per rank
(first-fit decreasing; 0 = ``micro_batch_size`` rows each); with ``share_prompts`` (default) a
prompt shared by several rows of a pass (GRPO's groups) is packed and run once, its rows'
responses attending it (same log-probs and gradients; ``bandpo.actor.packing``), and a
group's rows are kept in one pass where the budget allows. The optimizer-step boundary is
set explicitly, and ranks split micro-batches until all run the same number (ZeRO reduces
gradients every micro-batch). ``padding_free=False`` is the previous padded path with full
float32 logits, kept as the reference.

The forward passes (log-probs, entropy) are the methods of its base ``bandpo.actor.forward.ActorForward``,
the weight buckets for the rollout engines those of ``bandpo.actor.state_io.ActorStateIO``, checkpoints
and the HF export those of ``bandpo.checkpoint.actor_state.ActorCheckpoints``.

Every method that runs the model or touches parameters is collective under
data parallelism: all ranks must call it, the same number of times, in the same order.

NaN/inf: ``update`` refuses non-finite inputs (naming the tensor) before any forward. A
non-finite loss or gradient met during an optimizer step makes DeepSpeed discard that
step (its gradient-norm check zeroes the gradients instead of applying them); ``update``
counts such steps (``nonfinite_steps``) and raises if one was applied anyway.
"""

from __future__ import annotations

import gc
import math
import time

import torch

from bandpo.actor.chunked import DEFAULT_CHUNK, resolve_head
from bandpo.actor.ds_config import build_ds_config, grad_accum_steps
from bandpo.actor.forward import ActorForward
from bandpo.actor.logprobs import (
    check_padding,
)
from bandpo.actor.lora import LoraSettings
from bandpo.actor.loss_metrics import MetricAccumulator
from bandpo.actor.packing import (
    packed_budget_groups,
    split_to_count,
)
from bandpo.actor.rank_device import (
    check_rank_device,
    check_rank_precision,
    node_name,
    rank_report,
    weight_dtype,
)
from bandpo.actor.setup import (
    assigned_gpu,
    build_engines,
    cpu_threads_per_rank,
    destroy_engines,
    init_distributed,
    peak_memory_gib,
    seed_everything,
)
from bandpo.actor.state_io import ActorStateIO
from bandpo.algo.losses import policy_loss
from bandpo.algo.options import LossOptions
from bandpo.checkpoint.actor_state import ActorCheckpoints
from bandpo.config.checks import check_chunk, check_micro_batch_tokens, check_temperature, check_token_budget
from bandpo.run.nonfinite import first_nonfinite
from bandpo.types import TrainBatch

# Optional per-token batch fields ([n, r] like old_logprobs) handed to the loss by the same name.
_LOSS_TOKEN_FIELDS = ("old_entropy", "rollout_logprobs")


class Actor(ActorForward, ActorStateIO, ActorCheckpoints):
    """One data-parallel rank of the policy (and, optionally, a frozen reference model).

    Args:
        model_path: HF hub id or local folder of a causal LM.
        rank, world_size, master_addr, master_port: torch.distributed rendezvous; rank 0's
            address. ``master_port=None`` picks a free port (only valid with world_size 1).
        zero_stage: DeepSpeed ZeRO stage (2 default; 3 partitions parameters too).
        lr, betas, weight_decay: AdamW (decoupled weight decay on every parameter).
        warmup_steps: linear warmup over this many optimizer steps, then constant.
        grad_clip: max global gradient norm (0 disables).
        bf16: DeepSpeed's bf16 mode (bf16 weights/activations, fp32 master weights and gradient
            accumulation), on GPU or CPU (``bandpo.actor.ds_config``); fp32 otherwise.
        gradient_checkpointing: recompute activations in backward (less memory, ~30% slower).
        mini_batch_size: global rows per optimizer step (all ranks).
        micro_batch_size: rows per forward/backward on one rank.
        logprob_token_budget: tokens per no-grad forward in ``compute_logprobs`` (packed, or
            padded with ``padding_free=False``).
        padding_free: packed rows + chunked lm_head (default); False = padded rows, full logits.
        max_tokens_per_micro_batch: packed tokens per update micro-batch on one rank (0: group
            by ``micro_batch_size`` rows instead); needs ``padding_free``.
        logits_chunk_tokens: tokens per lm_head chunk (or per block of the online head) of the
            padding-free path.
        logprob_head: the padding-free path's lm_head implementation (``bandpo.actor.chunked.HEADS``);
            ``auto`` = ``online`` on CPU, ``chunked`` on GPU (``resolve_head``).
        fp32_head: that head's matmuls in float32 for a bf16 model (``model.fp32_head``).
        share_prompts: padding-free passes pack a prompt shared by several rows once (needs the
            packed attention, which replaces transformers' ``sdpa``; a model on another attention
            implementation packs every row's prompt).
        ref_model: also load a frozen copy of the initial weights for KL / ref logprobs.
        lora: ``bandpo.actor.lora.LoraSettings`` (or its fields as a dict); with rank > 0 only LoRA
            adapters train (ZeRO-2 or ZeRO-3), and the reference log-probs come from the same model with its
            adapters off, so ``ref_model`` loads nothing then.
        temperature: logits are divided by it (match the rollout's sampling temperature).
        seed: seeds python, numpy and torch.
        collective_timeout_min: how long a rank waits in a collective for the others (a checkpoint
            or HF export in progress) before the process group gives up and the run ends.
        cpu_threads: torch threads of this rank on CPU; None = this process's cores / world_size.
            Ray sets OMP_NUM_THREADS to an actor's ``num_cpus`` (1), which would run every
            forward and backward on one core; the CPU layout's stages run one after another
            (rollout, then the actor), so a rank may use its share of all cores. Ignored on GPU.
        offload_during_rollout: GPU: the states wait in host memory between ``offload`` and
            ``reload`` (``bandpo.actor.offload``), starting offloaded; ignored on CPU.
        expected_device: the plan's device for this rank ("cuda" | "cpu"; None: unchecked): another
            accelerator, or another precision than ``bf16`` says, is a ``RankDeviceError`` naming the
            node (``bandpo.actor.rank_device``), raised before the process group forms.

    On GPU each stage ends by returning PyTorch's cached free blocks to the device, so a colocated
    vLLM engine waking up finds the memory the actor's peak reserved.
    """

    def __init__(
        self,
        model_path: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        zero_stage: int = 2,
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        bf16: bool = False,
        gradient_checkpointing: bool = False,
        mini_batch_size: int,
        micro_batch_size: int,
        logprob_token_budget: int = 16384,
        padding_free: bool = True,
        max_tokens_per_micro_batch: int = 0,
        logits_chunk_tokens: int = DEFAULT_CHUNK,
        logprob_head: str = "auto",
        fp32_head: bool = False,
        share_prompts: bool = True,
        ref_model: bool = False,
        lora=None,
        temperature: float = 1.0,
        seed: int = 0,
        collective_timeout_min: float = 60,
        cpu_threads: int | None = None,
        offload_during_rollout: bool = False,
        expected_device: str | None = None,
    ):
        from bandpo.run.worker_logs import redirect_group_output

        redirect_group_output("actor")
        from deepspeed.accelerator import get_accelerator

        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        check_temperature(temperature)
        self.model_path, self.rank, self.world_size = model_path, rank, world_size
        self.zero_stage = zero_stage
        self.mini_batch_size, self.micro_batch_size = mini_batch_size, micro_batch_size
        self.logprob_token_budget, self.temperature = logprob_token_budget, temperature
        check_token_budget(logprob_token_budget, "logprob_token_budget")
        check_chunk(logits_chunk_tokens, "logits_chunk_tokens")
        check_micro_batch_tokens(max_tokens_per_micro_batch, padding_free)
        self.padding_free, self.max_tokens_per_micro_batch = padding_free, max_tokens_per_micro_batch
        self.logits_chunk_tokens = logits_chunk_tokens
        self.grad_accum = grad_accum_steps(mini_batch_size, micro_batch_size, world_size)
        seed_everything(seed)

        accel = get_accelerator()
        self.node = node_name()
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_rank_device(rank, expected_device, accel.device_name(), cuda_devices, self.node)
        self.on_cpu = accel.device_name() == "cpu"
        self.logprob_head = resolve_head(logprob_head, self.on_cpu)
        if fp32_head and not padding_free:
            raise ValueError(
                "fp32_head needs padding_free (the padded path's logits are the model's own lm_head)"
            )
        self.fp32_head = bool(fp32_head)
        # The GPU Ray assigned to this rank (bandpo.distributed.local_gpu_index), not a guess from the count.
        local_rank = 0 if self.on_cpu else assigned_gpu(rank, accel.device_count())
        init_distributed(
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            backend="gloo" if self.on_cpu else "nccl",
            timeout_min=collective_timeout_min,
        )
        if not self.on_cpu:
            accel.set_device(local_rank)
        self.device = torch.device(accel.device_name(local_rank))
        if self.on_cpu:
            torch.set_num_threads(cpu_threads or cpu_threads_per_rank(world_size))

        ds_config = build_ds_config(
            zero_stage=zero_stage,
            micro_batch_size=micro_batch_size,
            grad_accum=self.grad_accum,
            world_size=world_size,
            grad_clip=grad_clip,
            bf16=bf16,
        )
        self.lora = LoraSettings.of(lora)  # None when off
        self.engine, self.ref, packed_attention = build_engines(
            model_path,
            self.device,
            ds_config,
            zero_stage=zero_stage,
            bf16=bf16,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            gradient_checkpointing=gradient_checkpointing,
            padding_free=padding_free,
            ref_model=ref_model,
            lora=self.lora,
        )
        weights = weight_dtype(self.engine.module)
        if expected_device is not None:
            check_rank_precision(rank, bf16, self.engine.get_data_types()[0], weights, self.node)
        self.report = rank_report(rank, self.node, accel.device_name(), self.device, self.engine, weights)
        print(f"[bandpo] actor rank {rank}: {self.report}", flush=True)
        # Shared prompts need the packed attention (an attention row reads its group's prompt).
        self.share_prompts = share_prompts and packed_attention
        self.offloader = None
        if offload_during_rollout and not self.on_cpu:
            from bandpo.actor.offload import ActorOffload

            self.offloader = ActorOffload(self.engine, self.ref, zero_stage, self.device)
            self.offload()  # the engines generate first (and load their weights from the model's files)
            self.offload_weights()

    # ------------------------------------------------------------------ update
    def update(self, batch: TrainBatch, options: LossOptions) -> dict[str, float]:
        """Optimizer steps over ``batch`` (this rank's shard) with ``policy_loss(..., options)``.

        The shard is split in order into mini-batches of ``mini_batch_size / world_size`` rows
        (one optimizer step each) and those into micro-batches (``max_tokens_per_micro_batch``
        packed tokens, else ``micro_batch_size`` rows).
        ``options.norm_len``, when set, replaces the default ``seq-mean-token-sum-norm`` length (the
        longest response of the global mini-batch). Returns metrics averaged over the global batch,
        identical on every rank: token-weighted means of the loss metrics, ``loss``/``pg_loss``
        per optimizer step, ``grad_norm`` (over applied steps), ``lr``, ``num_tokens``,
        ``optimizer_steps``, ``nonfinite_steps`` (discarded for a NaN/inf loss or gradient),
        ``time_s``, ``tokens_per_s``, ``peak_memory_gib`` (the largest of the ranks' peaks since they
        started, ``bandpo.actor.setup.peak_memory_gib``).
        """
        return self._update(batch, options, keep_first=False, reuse_old=False)[0]

    def update_on_policy(
        self, batch: TrainBatch, options: LossOptions, as_old: bool = True
    ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """``update`` that returns its first optimizer step's forward, by default as its old log-probs.

        Before the first step the policy is the one of that step's forward, so for the rows of
        this rank's first mini-batch ``old = logprobs.detach()`` (ratio exactly 1) replaces a
        separate ``compute_logprobs`` pass; ``batch.old_logprobs`` is read for the later
        mini-batches' rows only (it may be None when there is one). With ``as_old=False``
        (``actor.old_logprobs=rollout``) ``batch.old_logprobs`` is pi_old for every row and the
        forward's log-probs are only returned, for the step's rollout/actor metrics. Returns
        ``(metrics as update(), logprobs [N, R], entropy [N, R])`` of the first mini-batch's rows
        (float32, CPU, 0.0 at padding and in every other row), the entropy of the same forward.
        """
        return self._update(batch, options, keep_first=True, reuse_old=as_old)

    def _update(self, batch: TrainBatch, options: LossOptions, keep_first: bool, reuse_old: bool):
        """``keep_first``: return the first step's forward (``update_on_policy``); ``reuse_old``: and use
        it as that step's old log-probs and pi_old's entropy."""
        start = time.perf_counter()
        self._check_update(batch, options, reuse_old)
        entropy_grad = options.entropy_coef != 0.0
        per_rank = self.mini_batch_size // self.world_size
        n_steps = batch.size // per_rank
        num_tokens, max_len = self._global_normalisers(batch.response_mask, n_steps, per_rank)
        shape = batch.response_ids.shape
        # [N, R] each: the first step's forward (log-probs, entropy)
        first_lp = torch.zeros(shape, dtype=torch.float32) if keep_first else None
        first_ent = torch.zeros(shape, dtype=torch.float32) if keep_first else None

        self.engine.train()
        acc = MetricAccumulator()
        for step in range(n_steps):
            keep = keep_first and step == 0
            reuse = reuse_old and keep  # the policy before the first step is this forward's
            lr = self.engine.get_lr()[0]  # the rate this optimizer step applies
            # read once per step: no sync per micro
            finite = torch.ones((), dtype=torch.bool, device=self.device)
            micros = self._micro_batches(batch, step * per_rank, per_rank)
            for k, idx in enumerate(micros):
                self.engine.set_gradient_accumulation_boundary(k == len(micros) - 1)
                rows = torch.tensor(idx)
                mb = batch.select(rows)
                # logprobs, entropy, r_mask: [n, r]
                logprobs, entropy, r_mask = self._forward(self.engine, mb, entropy_grad=entropy_grad)
                r = r_mask.shape[1]
                if keep:  # returned: the old log-probs below, or the rollout/actor metrics' actor side
                    first_lp[rows, :r] = logprobs.detach().cpu()
                    first_ent[rows, :r] = entropy.detach().float().cpu()
                if reuse:  # the policy before this step is the one of this forward: ratio == 1
                    # old_entropy [n, r] is pi_old's entropy too, computed before the loss (detached)
                    old, old_entropy = logprobs.detach(), entropy.detach()
                else:
                    old = mb.old_logprobs[:, :r].contiguous().to(self.device)
                ref_lp = (
                    None if mb.ref_logprobs is None else mb.ref_logprobs[:, :r].contiguous().to(self.device)
                )
                token_fields = {
                    f: getattr(mb, f)[:, :r].contiguous().to(self.device)
                    for f in _LOSS_TOKEN_FIELDS
                    if getattr(mb, f) is not None
                }
                if reuse:  # pi_old's entropy is this forward's too (adaptive band reads it)
                    token_fields["old_entropy"] = old_entropy
                loss, metrics = policy_loss(
                    logprobs,
                    old,
                    mb.advantages.to(self.device),
                    r_mask,
                    options,
                    num_tokens=num_tokens[step],
                    num_seqs=float(self.mini_batch_size),
                    max_len=float(max_len[step]),
                    ref_logprobs=ref_lp,
                    entropy=entropy,
                    **token_fields,
                )
                finite &= torch.isfinite(loss.detach())
                # DeepSpeed averages gradients over ranks; scale so they end up summed. A NaN loss is
                # back-propagated too: its NaN gradients make DeepSpeed discard the step (checked below).
                self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                self.engine.step()  # applies the optimizer only at the accumulation boundary
                acc.add_micro(metrics, r_mask.sum())
                del logprobs, entropy, loss
            grad_norm = self.engine.get_global_grad_norm()
            bad = self._discarded_nonfinite_step(bool(finite), grad_norm)
            acc.add_step(grad_norm=None if bad else grad_norm, lr=lr, nonfinite=bad)
        out = acc.reduce(self._all_reduce)
        self._release_cache()
        out["time_s"] = time.perf_counter() - start
        out["tokens_per_s"] = out["num_tokens"] / max(out["time_s"], 1e-9)
        peak = torch.tensor([peak_memory_gib(self.device)], dtype=torch.float64)
        out["peak_memory_gib"] = float(self._all_reduce(peak, max_=True)[0])  # the fullest rank's
        return out, first_lp, first_ent

    def _micro_batches(self, batch: TrainBatch, first: int, rows: int) -> list[list[int]]:
        """Row indices of the micro-batches of the mini-batch ``first .. first + rows``; every rank
        gets the same number of them (the busiest rank's)."""
        if not self.max_tokens_per_micro_batch:
            return [
                list(range(s, min(s + self.micro_batch_size, first + rows)))
                for s in range(first, first + rows, self.micro_batch_size)
            ]
        mini = batch.select(slice(first, first + rows))
        p_lens, r_lens = mini.prompt_mask.sum(-1).tolist(), mini.response_mask.sum(-1).tolist()
        groups = packed_budget_groups(
            p_lens, r_lens, self.max_tokens_per_micro_batch, self._prompt_keys(mini)
        )
        lengths = [p + r for p, r in zip(p_lens, r_lens)]
        count = int(self._all_reduce(torch.tensor([len(groups)]), max_=True))
        groups = split_to_count(groups, lengths, count)
        return [[first + i for i in g] for g in groups]

    def _discarded_nonfinite_step(self, loss_finite: bool, grad_norm) -> bool:
        """True when the optimizer step just taken met a NaN/inf loss or gradient on any rank.

        Such a step must have been discarded by DeepSpeed; one that was applied would have
        written NaN into the weights, so that raises FloatingPointError.
        """
        norm_finite = grad_norm is None or math.isfinite(float(grad_norm))
        bad = bool(self._all_reduce(torch.tensor([float(not (loss_finite and norm_finite))]), max_=True))
        if bad and self.engine.was_step_applied():
            raise FloatingPointError(
                "update: an optimizer step with a non-finite loss or gradient was applied "
                f"(loss finite: {loss_finite}, grad norm: {grad_norm}); the weights can no longer be trusted"
            )
        return bad

    def _check_update(self, batch: TrainBatch, options: LossOptions, reuse_old: bool = False) -> None:
        per_rank = self.mini_batch_size // self.world_size
        later_steps = batch.size > per_rank  # rows whose old log-probs must come from the batch
        missing = [
            f
            for f in ("advantages",) + (("old_logprobs",) if later_steps or not reuse_old else ())
            if getattr(batch, f) is None
        ]
        if missing:
            raise ValueError(f"update: batch is missing {', '.join(missing)}")
        # Everywhere, padding included: the loss masks by multiplying, and NaN * 0 is NaN.
        bad = first_nonfinite(
            batch, ("advantages", "old_logprobs", "ref_logprobs", "old_entropy"), masked=False
        )
        if bad:
            raise ValueError(f"update: batch.{bad} holds NaN/inf values; the trainer skips such steps")
        if not isinstance(options, LossOptions):
            raise TypeError(f"update: options must be a LossOptions, got {type(options).__name__}")
        if options.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError("update: kl_coef > 0 needs batch.ref_logprobs (compute_logprobs(ref=True))")
        if batch.size == 0 or batch.size % per_rank:
            raise ValueError(
                f"update: this rank's {batch.size} rows are not a positive multiple of "
                f"mini_batch_size/world_size = {self.mini_batch_size}/{self.world_size} = {per_rank}"
            )
        check_padding(batch.prompt_mask, batch.response_mask)

    def _global_normalisers(self, response_mask: torch.Tensor, n_steps: int, per_rank: int):
        """Per optimizer step: valid tokens summed over ranks, longest response over ranks."""
        lengths = response_mask.sum(-1).view(n_steps, per_rank).to(torch.float64)  # [steps, rows]
        tokens = self._all_reduce(lengths.sum(-1))
        longest = self._all_reduce(lengths.max(-1).values, max_=True)
        if bool((tokens == 0).any()):
            raise ValueError("update: a mini-batch has no response tokens (all response_mask zero)")
        return tokens.tolist(), longest.clamp(min=1).tolist()

    # ------------------------------------------------------------------ offload
    def offload(self) -> None:
        """Before the engines wake: the states to host memory (``bandpo.actor.offload``); else nothing."""
        if self.offloader is not None:
            self.offloader.offload()

    def offload_weights(self) -> None:
        """Once the weight sync has read them: the bf16 weights DeepSpeed can move; else nothing."""
        if self.offloader is not None:
            self.offloader.offload_weights()

    def reload(self) -> None:
        """Once the engines sleep: the states back on the GPU; else nothing."""
        if self.offloader is not None:
            self.offloader.reload()

    def _release_cache(self) -> None:
        if not self.on_cpu:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().empty_cache()

    # ------------------------------------------------------------------ misc
    def close(self) -> None:
        """Release this rank's memory while the process lives on (a Ray actor's process simply exits;
        ``python -m bandpo.tools.gpu_smoke`` builds one rank after another): ``bandpo.actor.setup.destroy_engines``."""
        destroy_engines([self.engine, self.ref], self.zero_stage)
        self.engine = self.ref = self.offloader = None
        gc.collect()
        self._release_cache()

    def info(self) -> dict:
        """``rank_report`` (node, accelerator, device, precision), world size, torch threads and optimizer
        steps taken (also a cheap liveness probe for Ray)."""
        return {
            **self.report,
            "threads": torch.get_num_threads(),
            "world_size": self.world_size,
            "zero_stage": self.zero_stage,
            "global_steps": int(self.engine.global_steps),
        }
