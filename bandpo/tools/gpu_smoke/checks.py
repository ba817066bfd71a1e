"""The checks of ``python -m bandpo.tools.gpu_smoke`` (its docstring says what each measures and why): one ZeRO
stage's reference, update, memory, offload (pinned host memory), packed and teardown checks on random shared-prompt groups
(``check_stage``), the CUDA IPC round trip (``ipc_round_trip``), and the arithmetic they report
against (MFU, the log-prob tolerance of a dtype)."""

from __future__ import annotations

import ctypes
import gc
import math
import threading
import time
import traceback
import weakref

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 2.0**-24}
GROUP = 4  # rows sharing one prompt, as GRPO's samples of a prompt do


def mfu(params: int, tokens: int, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of a training step: 6 x params x tokens (forward 2, backward 4) / time / peak.

    Model FLOPs, not hardware FLOPs: gradient checkpointing's recomputed forward (2 more) and
    attention's score products are not counted, as in the PaLM paper's definition.
    """
    return None if peak is None else 6.0 * params * tokens / seconds / peak


def logprob_tolerance(dtype: str, max_abs_logit: float, layers: int, hidden: int) -> float:
    """Max |delta log-prob| expected between two kernels' orderings of the same network in ``dtype``.

    A log-prob z_y - logsumexp(z) moves by at most 2 max|delta z|. Each layer ends in a rounding
    of the residual stream to ``dtype`` (unit roundoff u: 2^-8 bf16, 2^-24 fp32) where the two
    paths may round apart by one unit; over L layers, 2 roundings each, those differences add
    like a random walk: |delta z| ~ u (1 + max|z|) sqrt(2L). In fp32 the roundings of the
    H-term dot products (accumulation order differs between kernels) dominate instead: a further
    factor sqrt(H). bf16 GEMMs accumulate in fp32, so that factor does not apply there.
    """
    u = UNIT_ROUNDOFF[dtype]
    accumulate = math.sqrt(hidden) if dtype == "float32" else 1.0
    return 2.0 * u * (1.0 + max_abs_logit) * math.sqrt(2 * layers) * accumulate


def random_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """``rows`` random rollouts in groups of ``GROUP`` sharing one prompt (up to ``prompt`` tokens),
    each with its own response (up to ``response`` tokens), as a GRPO step samples them."""
    import torch

    from bandpo.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)

    def ids(hi):
        n = int(torch.randint(hi // 2, hi + 1, (1,), generator=g))
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    groups = [ids(prompt) for _ in range(math.ceil(rows / GROUP))]
    prompts = [list(groups[i // GROUP]) for i in range(rows)]
    responses = [ids(response) for _ in range(rows)]
    return RolloutBatch.from_lists(
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        [i // GROUP for i in range(rows)],
        ["stop"] * rows,
        pad_id=0,
    )


def computed_tokens(rb) -> int:
    """Tokens one packed forward with shared prompts runs: each distinct prompt once, every response."""
    from bandpo.actor.packing import prompt_keys

    return int(sum(len(k) for k in set(prompt_keys(rb.prompt_ids, rb.prompt_mask))) + rb.response_mask.sum())


def plan_estimate(
    params: int, shape: dict, stage: int, args, bf16: bool, lora_rank: int = 0, grad_ckpt: bool | None = None
) -> float | None:
    """The placement plan's ``actor_peak`` (GiB) for this model and batch on one colocated GPU;
    ``lora_rank`` > 0: LoRA on every target of that rank (the config's default targets);
    ``grad_ckpt``: gradient checkpointing (None: ``args.grad_ckpt``)."""
    from bandpo.config import compose
    from bandpo.distributed.memory import memory_estimate
    from bandpo.distributed.plan import ClusterShape, make_plan

    ckpt = str(args.grad_ckpt if grad_ckpt is None else grad_ckpt).lower()
    cfg = compose(
        [
            "model=qwen2.5-3b",
            f"model.num_params={params}",
            f"model.hidden_size={shape['hidden_size']}",
            f"model.num_layers={shape['num_hidden_layers']}",
            f"model.vocab_size={shape['vocab_size']}",
            f"model.max_model_len={args.prompt + args.response}",
            f"model.gradient_checkpointing={ckpt}",
            f"actor.gradient_checkpointing={ckpt}",
            "actor.num_workers=1",
            "rollout.num_workers=1",
            f"actor.zero_stage={stage}",
            f"actor.micro_batch_size={args.rows}",
            "actor.padding_free=true",
            f"actor.max_tokens_per_micro_batch={args.token_budget}",
            f"actor.bf16={str(bf16).lower()}",
            f"actor.lora.rank={lora_rank}",
            "algorithm.kl_coef=0",
        ]
    )
    # The finer layer shape (SwiGLU width, attention heads) of the benchmarked model.
    cfg.model.intermediate_size = shape["intermediate_size"]
    cfg.model.num_heads = shape["num_attention_heads"]
    cfg.model.num_kv_heads = shape["num_key_value_heads"]
    est = memory_estimate(cfg, make_plan(cfg, ClusterShape(1, 1), "cuda"))
    return None if est is None else est.parts["actor_peak"]


def estimate_or_error(*a, **kw) -> tuple[float | None, str | None]:
    """``(plan_estimate(...), None)``, or ``(None, the error)`` when the plan cannot be computed here
    (e.g. Hydra is not installed): the stage's measurements are kept either way."""
    try:
        return plan_estimate(*a, **kw), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


class PeakMemory:
    """Peak memory of a block, GiB: CUDA's allocator peak on GPU; on CPU the largest resident set
    (sampled every ms) above ``baseline`` bytes."""

    def __init__(self, cuda: bool, baseline: int = 0):
        self.cuda, self.baseline, self.peak_gib = cuda, baseline, None

    @staticmethod
    def rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    @classmethod
    def live_rss(cls) -> int:
        """The resident set after glibc returns its freed-but-kept heap (``malloc_trim(0)``): a
        baseline that counts live memory only. An untrimmed one can hold a previous actor's freed
        pages, which glibc may return during the block, so the peak above it could come out
        negative. Garbage is collected first for the same reason."""
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: nothing kept to return
        return cls.rss()

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self._top, self._stop = self.rss(), threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._top = max(self._top, self.rss())

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        else:
            self._stop.set()
            self._thread.join()
            self.peak_gib = (max(self._top, self.rss()) - self.baseline) / 2**30
        return False


def allocated_gib(cuda: bool) -> float | None:
    import torch

    return torch.cuda.memory_allocated() / 2**30 if cuda else None


def actor_states(actor) -> list:
    """Every tensor an offload moves, as CPU copies: the full weights (gathered under ZeRO-3), the
    fp32 master partitions and Adam's moments."""
    import torch

    opt = actor.engine.optimizer
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
    out = [t.detach().to("cpu", copy=True) for bucket in actor.named_weights() for _, t in bucket]
    out += [t.detach().to("cpu", copy=True) for t in masters]
    out += [
        v.to("cpu", copy=True)
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    return out


def pinned_gib(cuda: bool) -> float | None:
    """GiB torch's pinned (caching host) allocator holds now, every block at its rounded size; None on CPU."""
    import torch

    if not cuda:
        return None
    return torch.cuda.host_memory_stats().get("reserved_bytes.current", 0) / 2**30


def pinned_plan_gib(shape: dict, params: int, stage: int, lp: int) -> float:
    """The plan's pinned host memory of one rank with a reference model (``bandpo.distributed.host_memory``)."""
    from bandpo.distributed.footprint import ModelShape
    from bandpo.distributed.host_memory import pinned_terms

    model = ModelShape(
        num_params=params,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_layers=shape["num_hidden_layers"],
        num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        vocab_size=shape["vocab_size"],
    )
    return sum(p for _, _, p in pinned_terms(model, 1, stage, lp, params, lora=False, ref=True)) / 2**30


def offload_round_trip(actor, stage: int, cuda: bool) -> dict:
    """``ActorOffload`` after a real optimizer step: what it frees, the pinned host memory it takes (GPU),
    and that reload restores all."""
    import torch

    from bandpo.actor.offload import ActorOffload

    if actor.offloader is None:  # CPU: the trainer never offloads there, the code path runs all the same
        actor.offloader = ActorOffload(actor.engine, actor.ref, stage, actor.device)
    before = actor_states(actor)
    resident = allocated_gib(cuda)
    pinned_before = pinned_gib(cuda)
    actor.offload()
    actor.offload_weights()
    offloaded = allocated_gib(cuda)
    pinned = pinned_gib(cuda)
    actor.reload()
    after = actor_states(actor)
    if len(before) != len(after):
        raise RuntimeError(f"offload round trip: {len(before)} state tensors before, {len(after)} after")
    diff = max(
        0.0 if torch.equal(a, b) else float((a.float() - b.float()).abs().max())
        for a, b in zip(before, after)
    )
    return {
        "offload_max_diff": diff,
        "offload_states": len(before),
        "offload_freed_gib": None if not cuda else resident - offloaded,
        "pinned_gib": None if not cuda else pinned - pinned_before,
    }


def check_stage(model_dir: str, stage: int, args, shape: dict, params: int, dtype: str) -> dict:
    """update / memory / offload / packed / teardown for one ZeRO stage (see the module docstring).

    A failure is recorded in the row (``error``, with the phase it happened in) beside what was
    measured before it; it never raises, so the next stage runs."""
    import torch

    out: dict = {"zero_stage": stage, "phase": "build"}
    refs: list = []  # a weak reference to the actor's module: freed once closed
    try:
        _run_stage(out, model_dir, stage, args, shape, params, dtype, refs)
    except Exception as e:  # recorded; the next stage runs
        out["error"] = f"{out['phase']}: {type(e).__name__}: {e}"
        traceback.print_exc()
    gc.collect()
    if not args.cpu:
        torch.cuda.empty_cache()
    out["freed_after_close"] = refs[0]() is None if refs else None  # nothing holds the model
    out["left_after_close_gib"] = allocated_gib(not args.cpu)
    return out


def _run_stage(
    out: dict, model_dir: str, stage: int, args, shape: dict, params: int, dtype: str, refs
) -> None:
    import torch

    from bandpo.actor import Actor
    from bandpo.algo.options import LossOptions
    from bandpo.types import TrainBatch

    cuda = not args.cpu
    rb = random_batch(args.rows, args.prompt, args.response, shape["vocab_size"])
    loss = LossOptions(
        algorithm="bandpo",
        divergence="kl",
        delta=0.05,
        upper_cap=10.0,
        agg="seq-mean-token-mean",
        kl_coef=1e-3,
    )
    baseline = PeakMemory.live_rss()
    actor = Actor(
        model_dir,
        zero_stage=stage,
        bf16=cuda,
        mini_batch_size=args.rows,
        micro_batch_size=args.rows,
        lr=1e-5,
        max_tokens_per_micro_batch=args.token_budget,
        logprob_token_budget=args.token_budget,
        gradient_checkpointing=args.grad_ckpt,
        offload_during_rollout=cuda,
        ref_model=True,
    )
    refs.append(weakref.ref(actor.engine.module))
    try:
        # The trainer's order of a step: reload (stage 5), old and reference log-probs, update with the KL
        # term, offload before the engines wake, offload_weights once the sync read them; then reload.
        out["phase"] = "update"
        actor.reload()  # an offloading actor starts with its states in host memory, as before a first rollout
        old, _ = actor.compute_logprobs(rb)
        out["phase"] = "reference"
        ref, _ = actor.compute_logprobs(rb, ref=True)
        mask = rb.response_mask.bool()
        # Before any update the policy is the reference: the two models' forwards of the same weights.
        out["ref_first_diff"] = float((ref - old)[mask].abs().max())
        batch = TrainBatch.from_rollout(rb, advantages=torch.linspace(-1, 1, args.rows), old_logprobs=old)
        batch.ref_logprobs = ref
        out["phase"] = "update"
        actor.update(batch, loss)  # warm-up: kernel selection, Adam's states allocated by a real step
        out["phase"] = "offload"
        out.update(offload_round_trip(actor, stage, cuda))
        out["pinned_plan_gib"] = pinned_plan_gib(shape, params, stage, 2 if cuda else 4)
        out["phase"] = "reference"
        # the reference went to host memory and back: frozen, so its log-probs are those of before, bit for bit
        again, _ = actor.compute_logprobs(rb, ref=True)
        out["ref_reload_diff"] = float((again - ref)[mask].abs().max())
        out["phase"] = "memory"
        with PeakMemory(cuda, baseline) as peak:
            m = actor.update(batch, loss)
        tokens = computed_tokens(rb)
        out.update(
            update_s=m["time_s"],
            tokens=tokens,
            tokens_per_s=tokens / m["time_s"],
            mfu=mfu(params, tokens, m["time_s"], args.peak),
            peak_gib=peak.peak_gib,
        )
        out["estimate_gib"], out["estimate_error"] = estimate_or_error(params, shape, stage, args, bf16=cuda)
        out["peak_over_estimate"] = None if not out["estimate_gib"] else out["peak_gib"] / out["estimate_gib"]

        out["phase"] = "packed"
        # packed attention + shared prompts + chunked head vs the padded reference with full logits
        # Two padded rows a forward: their float32 logits and softmax take 2 x 4 B x V per token.
        actor.padding_free, actor.share_prompts = False, False
        actor.logprob_token_budget = 2 * (args.prompt + args.response)
        padded, _ = actor.compute_logprobs(rb)
        actor.padding_free, actor.share_prompts = True, True
        actor.logprob_token_budget = args.token_budget
        packed, _ = actor.compute_logprobs(rb)
        # The largest |log p| stands in for max|z|: log-softmax is shift-invariant, and z_max - z_y <= -log p_y.
        logits_max = float(padded[mask].abs().max())
        out["packed_max_err"] = float((packed - padded)[mask].abs().max())
        out["packed_tol"] = logprob_tolerance(
            dtype, logits_max, shape["num_hidden_layers"], shape["hidden_size"]
        )
        out["packed_ok"] = out["packed_max_err"] <= out["packed_tol"]
        # the actor's and the reference's forwards: one model's two copies, within the packed bound
        out["ref_ok"] = out["ref_reload_diff"] == 0.0 and out["ref_first_diff"] <= out["packed_tol"]
        out["phase"] = "done"
    finally:
        actor.close()
        del actor


def _ipc_receiver(inbox, outbox) -> None:
    import torch

    from bandpo.weight_sync.ipc import open_ipc_bucket

    while (msg := inbox.get()) is not None:
        uuid, payload = msg
        for _, view in open_ipc_bucket({uuid: payload}):
            torch.empty_like(view).copy_(view)  # the engine's load: one copy out of the bucket
        torch.cuda.synchronize()
        outbox.put(True)


def ipc_round_trip(model_dir: str, bucket_bytes: int = 256 << 20) -> dict:
    """GB/s of packing the model's weights into IPC buckets and copying them out in another process."""
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from bandpo.weight_sync.ipc import pack_ipc_bucket

    weights = list(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().named_parameters()
    )
    buckets, cur, size = [], [], 0
    for name, p in weights:
        if cur and size + p.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, p.detach()))
        size += p.nbytes
    buckets.append(cur)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(inbox, outbox))
    proc.start()
    total = sum(p.nbytes for _, p in weights)

    def one_pass() -> float:
        t0 = time.perf_counter()
        for bucket in buckets:
            uuid, payload, buf = pack_ipc_bucket(bucket)
            inbox.put((uuid, payload))
            outbox.get(timeout=300)
            del buf
        return time.perf_counter() - t0

    try:
        one_pass()  # warm-up: the receiver's CUDA context and IPC mappings
        seconds = min(one_pass() for _ in range(3))
    finally:
        inbox.put(None)
        proc.join(timeout=60)
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    copy_gbs = 5 * a.nbytes / (time.perf_counter() - t0) / 1e9
    ipc_gbs = total / seconds / 1e9
    return {
        "ipc_bytes": total,
        "ipc_buckets": len(buckets),
        "ipc_s": seconds,
        "ipc_gbs": ipc_gbs,
        "device_copy_gbs": copy_gbs,
        "ipc_over_copy": ipc_gbs / copy_gbs,
    }
