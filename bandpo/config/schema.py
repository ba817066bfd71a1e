"""The training config's one schema: every key with its type, default and a one-line doc.

Why dataclasses as Hydra structured configs (and not pydantic, as prime-rl uses): Hydra already
composes the groups and the command line, and OmegaConf checks each value against the dataclass's
type as it merges (``actor.lr=abc`` fails naming ``actor.lr``) and refuses a key the dataclass does
not have, with no second library or conversion layer; ``bandpo.eval`` took the same route. The
composed config is then turned into these dataclasses (``compose``), so the code below the trainer
reads typed sections: ``RolloutConfig``, ``ActorConfig``, ...

The group files in ``configs/`` hold only what a choice sets (an algorithm's thresholds, a model's
sizes and scale); every default is here. The rules that span keys (a mini-batch divides the step's
prompts, an option set for an algorithm that does not read it, ...) run on the typed config
(``bandpo.config.rules``, ``bandpo.config.algorithm``). ``docs/configuration.md``'s key table is
written from this module (``python -m bandpo.config.reference``) and a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any


def key(default: Any = MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """A config key: its default (``factory`` for a list or mapping) and its one-line doc."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default="???" if default is MISSING else default, metadata={"doc": doc})


@dataclass
class LoraConfig:
    rank: int = key(
        0, "0 = off (full fine-tuning); > 0: LoRA adapter rank r, the reference policy is the base model"
    )
    alpha: float = key(16.0, "the adapter's output is scaled by alpha / rank")
    dropout: float = key(
        0.0,
        "on the adapter's input while training; > 0 needs actor.reuse_old_logprobs=false, old_logprobs=recompute",
    )
    target_modules: list[str] = key(
        doc="nn.Linear names that get adapters (Qwen2, Llama)",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    export: str = key(
        "both",
        "final export: merged (<output_dir>/hf, the adapter merged in) | adapter (<output_dir>/hf_adapter, PEFT) | both",
    )


@dataclass
class ActorConfig:
    num_workers: int = key(1, "data-parallel DeepSpeed ranks (one GPU each)")
    gpus: int | None = key(
        None, "split layout: GPUs for the ranks (with rollout.gpus); null = colocated on GPU"
    )
    zero_stage: int = key(2, "DeepSpeed ZeRO stage: 2 | 3")
    lora: LoraConfig = key(
        doc="LoRA adapters train instead of the whole model (ZeRO-2 or ZeRO-3)", factory=LoraConfig
    )
    offload_during_rollout: bool | None = key(
        None,
        "optimizer state, masters, grads and ref model in host memory while vLLM generates; null = on colocated on GPU",
    )
    lr: float = key(1.0e-6, "AdamW learning rate")
    betas: list[float] = key(doc="AdamW betas", factory=lambda: [0.9, 0.999])
    weight_decay: float = key(0.01, "AdamW weight decay")
    warmup_steps: int = key(0, "linear warm-up of the learning rate, in optimizer steps")
    grad_clip: float = key(1.0, "gradient norm clip")
    bf16: bool | str = key(
        "auto", "auto = bf16 on GPU, and on a CPU with avx512_bf16 or amx_bf16; fp32 elsewhere"
    )
    gradient_checkpointing: bool = key(False, "recompute activations in the backward pass")
    mini_batch_prompts: int = key(64, "prompts per optimizer step (x rollout.n rows)")
    micro_batch_size: int = key(8, "rows per forward/backward when max_tokens_per_micro_batch=0")
    logprob_token_budget: int = key(16384, "tokens per no-grad log-prob forward (per rank)")
    padding_free: bool = key(
        True, "rows packed without padding + chunked lm_head; false = padded rows, full logits"
    )
    max_tokens_per_micro_batch: int = key(
        16384, "packed tokens per update forward/backward per rank; 0 = micro_batch_size rows"
    )
    collective_timeout_min: float = key(60, "minutes a rank waits in a collective for the others")
    cpu_threads: int | None = key(None, "CPU: torch threads per rank; null = the node's cores / ranks")
    logits_chunk_tokens: int = key(
        512, "tokens per lm_head chunk (chunked: memory ~ 3 x chunk x vocab x 4 B) or block (online)"
    )
    logprob_head: str = key(
        "auto",
        "lm_head log-prob/entropy: online (one pass over vocab tiles) | chunked | auto = online on CPU",
    )
    share_prompts: bool = key(True, "padding-free: a prompt shared by a group's rows is packed once per pass")
    reuse_old_logprobs: bool | str = key(
        "auto", "auto | true | false: the first optimizer step's old log-probs come from its own forward"
    )
    old_logprobs: str = key(
        "recompute",
        "pi_old: recompute (the actor's pass) | rollout (the engines' sampling log-probs, no pass)",
    )
    epochs: int = key(1, "passes over each rollout batch")


@dataclass
class RolloutConfig:
    backend: str = key("vllm", "the rollout engine: vllm | hf")
    n: int = key(32, "responses per prompt (group size G)")
    temperature: float = key(1.0, "sampling temperature")
    top_p: float = key(1.0, "nucleus sampling")
    top_k: int = key(-1, "top-k sampling; -1 = off")
    max_tokens: int = key(4096, "response cap in tokens")
    num_workers: int = key(1, "data-parallel rollout engines")
    tensor_parallel_size: int = key(1, "GPUs per engine")
    gpu_memory_utilization: float = key(0.5, "vLLM's share of a GPU")
    kv_cache_gib: int = key(2, "CPU only: GiB of RAM for the KV cache (VLLM_CPU_KVCACHE_SPACE, an integer)")
    cpu_threads: int | None = key(None, "CPU only: torch threads per engine; null = the cores / engines")
    max_num_seqs: int | None = key(
        None, "vLLM: sequences decoded at once per engine; null = vLLM's default (256 on CPU)"
    )
    enable_sleep_mode: bool | str = key("auto", "auto = on GPU when colocated with the actor")
    sleep_level: int = key(
        1, "vLLM sleep mode: 1 = weights wait in host memory; 2 = dropped, reloaded every wake"
    )
    enforce_eager: bool | str = key("auto", "auto = false on GPU (CUDA graphs), true on CPU")
    gpus: int | None = key(
        None, "split layout: GPUs for the engines (with actor.gpus); null = colocated on GPU"
    )
    weight_sync: str = key("auto", "actor -> engine weights: auto | ipc | nccl | shm")
    lora_sync: str = key("auto", "with actor.lora.rank > 0: auto | adapter | merged")
    sync_check_tol: float | int | str = key(
        "auto", "stale-weights check tolerance: auto | off | a number (bandpo.trainer.sync_check)"
    )
    inject_stale_adapter: int = key(
        0, "test hook: from this adapter load on engines reload without load_inplace"
    )
    verify_sync: bool = key(False, "compare the engines' weights with the actor's after every sync")
    weight_sync_timeout: float = key(300, "seconds any one wait of the ipc / nccl / adapter sync may take")


@dataclass
class BandConfig:
    divergence: str = key("kl", "the trust region's f-divergence: kl | tv | chi2")
    delta: float = key(0.05, "the trust region's radius")
    upper_cap: float | None = key(10.0, "ceiling of the band's upper bound; null for the pure band")
    relax_high_p: bool = key(False, "union with [1 - eps_low, 1 + eps_high]")
    adaptive: str = key("none", "none | entropy: per-token delta_t from pi_old's token entropy")
    adaptive_norm: str = key("batch", "batch: h = H / (H + mean H of the step) | logv: h = H / log V")
    delta_min: float | None = key(None, "delta_t at h = 0; null = delta / 4")
    delta_max: float | None = key(None, "delta_t at h = 1; null = 4 delta")


@dataclass
class MismatchConfig:
    mode: str = key(
        "none", "rollout/trainer mismatch correction: none | token_tis | seq_tis | token_mis | ..."
    )
    cap: float = key(2.0, "C: truncation (tis), drop above (mis), keep [1/C, C] (icepop)")


@dataclass
class FilterGroupsConfig:
    enable: bool = key(False, "DAPO dynamic sampling: drop groups whose metric is all equal, sample more")
    metric: str = key("acc", "acc | reward")
    max_gen_rounds: int = key(10, "rollout rounds per step at most; then train on what there is")


@dataclass
class AlgorithmConfig:
    name: str = key(doc="the algorithm (bandpo.algo registry)")
    eps_low: float | None = key(0.2, "lower threshold: the ratio's, dcpo's |r - 1| r q, dppo's divergence")
    eps_high: float | None = key(0.2, "upper threshold (as eps_low)")
    dual_clip: float | None = key(
        10.0, "c of the dual clip for A < 0 (clipped surrogate only); null disables"
    )
    ratio_cap: float | None = key(None, "dppo only: C of the truncated ratio min(r, C)")
    upper_cap: float | None = key(None, "dcpo only: ceiling of its per-token upper bound")
    tau_pos: float | None = key(None, "sapo only: gate temperature for A > 0")
    tau_neg: float | None = key(None, "sapo only: gate temperature for A <= 0")
    cov_ratio: float | None = key(
        None, "clip_cov / kl_cov only: share of a micro-batch's valid tokens selected by covariance"
    )
    clip_cov_lb: float | None = key(None, "clip_cov only: its candidates' covariance is > this")
    clip_cov_ub: float | None = key(None, "clip_cov only: its candidates' covariance is < this")
    kl_cov_coef: float | None = key(None, "kl_cov only: weight of |log r| on the selected tokens")
    loss_agg: str = key("seq-mean-token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum[-norm]")
    kl_coef: float = key(0.001, "KL(pi || pi_ref) in the loss; 0 disables the reference model")
    kl_estimator: str = key("k3", "k1 | k2 | k3")
    entropy_coef: float = key(0.0, "entropy bonus weight; with entropy_target, its starting value")
    entropy_target: float | None = key(
        None, "adaptive entropy bonus: target mean token entropy (nats); null = entropy_coef fixed"
    )
    entropy_coef_delta: float | None = key(None, "with entropy_target: the coefficient's step; null = 0.005")
    entropy_coef_min: float | None = key(None, "with entropy_target: the coefficient's floor; null = 0")
    entropy_coef_max: float | None = key(None, "with entropy_target: the coefficient's ceiling; null = 1")
    top_entropy_quantile: float = key(
        1.0, "rho: the policy loss keeps the top-rho fraction of tokens by entropy; 1 = every token"
    )
    advantage: str = key("grpo", "grpo | grpo_no_std (Dr. GRPO)")
    tis_cap: float | None = key(None, "C of token-level truncated importance sampling; null = off")
    mismatch: MismatchConfig = key(doc="rollout/trainer mismatch correction", factory=MismatchConfig)
    filter_groups: FilterGroupsConfig = key(doc="DAPO dynamic sampling", factory=FilterGroupsConfig)
    band: BandConfig | None = key(
        None, "the band's trust region (the algorithms with a band; null for the others)"
    )


@dataclass
class TrainSource:
    name: str | None = key(None, "a registered set or hub id")
    path: str | None = key(None, "a local JSONL/parquet file (with name: a local copy of that set)")
    problem_key: str | None = key(None, "the problem's field")
    answer_key: str | None = key(None, "the answer's field")
    id_key: str | None = key(None, "the row id's field")
    split: str | None = key(None, "the split of a hub or generated set")
    limit: int | None = key(None, "first N rows")
    size: int | None = key(None, "a generated set's size")
    seed: int | None = key(None, "a generated set's seed")
    kinds: list[str] | None = key(
        None, "tiny_arith's problem kinds (add, sub, mul, two_step, word); null = all"
    )
    difficulty: int | None = key(None, "tiny_arith's level, 1-4 (the most digits of an operand); null = 1")
    part: str | None = key(
        None, "tiny_arith's half of the train split: warm (the tiny model's warm start) | rl; null = all"
    )


@dataclass
class DataConfig:
    train: list[TrainSource] = key(doc="training sources", factory=list)
    template: str = key("dapo", "prompt template: dapo (an 'Answer:' line) | boxed")
    answer_format: str | None = key(
        None, "what the verifier extracts: dapo | boxed | auto; null = the template's"
    )
    max_prompt_len: int = key(1024, "longer prompts are dropped")
    shuffle_seed: int = key("${trainer.seed}", "the training order's seed")


@dataclass
class ModelConfig:
    name: str = key(doc="the run's model name (output folder, logs)")
    path: str = key(doc="hub id or local folder")
    build: str | None = key(None, "build (and cache) the model: tiny_arith | smollm2_gguf")
    build_args: dict[str, Any] = key(doc="fields of the build's BuildArgs", factory=dict)
    dtype: str = key("auto", "the rollout engines' dtype; auto = the actor's precision")
    fp32_head: bool = key(
        False,
        "bf16 runs: the lm_head's matmul in float32 on the actor (padding-free) and in vLLM (head_dtype)",
    )
    max_model_len: int = key(5120, "prompt + response tokens")
    gradient_checkpointing: bool = key(False, "this model needs actor activation checkpointing")
    num_params: int | None = key(None, "parameters (memory estimate)")
    hidden_size: int | None = key(None, "hidden size (memory estimate)")
    intermediate_size: int | None = key(None, "MLP size (memory estimate)")
    num_layers: int | None = key(None, "layers (memory estimate)")
    num_heads: int | None = key(None, "attention heads (memory estimate)")
    num_kv_heads: int | None = key(None, "KV heads (memory estimate)")
    vocab_size: int | None = key(None, "vocabulary (memory estimate)")


@dataclass
class RewardConfig:
    correct: float = key(1.0, "reward of a correct answer")
    incorrect: float = key(-1.0, "reward of a wrong or missing answer")
    format_penalty: float | None = key(None, "reward when no answer could be extracted; null = incorrect's")
    overlong_buffer: int = key(0, "DAPO's soft overlong penalty: the last tokens before the cap; 0 = off")
    overlong_penalty: float = key(1.0, "the penalty at the cap")
    random_p: float | None = key(
        None,
        "diagnostics: the reward is correct's with probability p else incorrect's, independent of the "
        "answer (seeded by trainer.seed, step, row; reward/accuracy stays the grading's); null = graded",
    )


@dataclass
class WandbConfig:
    mode: str = key("offline", "offline | online | disabled")
    project: str = key("bandpo", "the W&B project")


@dataclass
class TrainerConfig:
    total_steps: int = key(500, "training steps")
    prompts_per_step: int = key(256, "prompts per step")
    seed: int = key(0, "the run's seed")
    max_staleness: int = key(0, "0: synchronous | 1: one-step off-policy")
    device: str = key("auto", "auto | cpu | cuda")
    output_dir: str = key("runs/${model.name}-${algorithm.name}-s${trainer.seed}", "the run folder")
    resume: str = key("auto", "auto = latest complete checkpoint in output_dir; never = start fresh")
    save_every: int = key(10, "checkpoint every k steps (and the last); 0 = never")
    keep_last: int = key(3, "checkpoints kept")
    eval_every: int = key(5, "evaluate every k steps (and before the first); 0 = off")
    eval_before_train: bool = key(True, "evaluate before the first step")
    export_hf: bool = key(True, "final HF export to <output_dir>/hf")
    on_nonfinite: str = key("skip", "skip | stop: a NaN/inf in log-probs, rewards or loss")
    max_skipped_steps: int = key(5, "skipped steps before the run stops")
    trace_every: int = key(0, "every k steps write <output_dir>/traces/; 0 = off")
    trace_max_chars: int = key(2000, "texts in traces are cut to this many characters")
    entropy_first_n: int = key(
        32, "entropy/ended_first_n: the rollout entropy over the first N tokens of responses that ended"
    )
    verifier_actors: int | str = key(1, "Ray actors grading rewards: a number, or per_node")
    verifier_workers: int | None = key(
        None, "grading processes per verifier actor; null = its node's CPUs - 1"
    )
    verifier_timeout: float = key(5.0, "seconds to grade one response")
    verifier_memory_gib: float | None = key(4.0, "address-space cap per grading process; null = none")
    max_error_share: float = key(0.5, "a step with more responses graded `error` stops the run")
    inject_nonfinite_step: int = key(0, "test hook: inject a NaN at this step; 0 = off")
    inject_nonfinite: str = key("rewards", "test hook: rewards | logprobs")
    nnodes: int | None = key(None, "cluster shape for the placement plan; null = the cluster found")
    gpus_per_node: int | None = key(None, "cluster shape for the placement plan; null = the cluster found")
    gpu_memory_gib: float | None = key(None, "one GPU's memory for the plan's fit check; null = reported")
    dry_run: bool = key(False, "print the placement plan and exit (0 fits, 2 does not)")
    reward: RewardConfig = key(doc="the reward scheme", factory=RewardConfig)
    wandb: WandbConfig = key(doc="W&B logging", factory=WandbConfig)
    verbose: bool = key(False, "workers' output on the console, not <run>/logs/")
    ray_address: str | None = key(None, "null = $RAY_ADDRESS or a local instance")
    startup_timeout: float = key(
        1800, "seconds the actor ranks and the engines may take to start; then an error naming the late ones"
    )


@dataclass
class TrainEvalConfig:
    datasets: list[str] = key(doc="held-out sets", factory=lambda: ["amc23", "aime24", "aime25"])
    paths: dict[str, str] = key(doc="name -> local JSONL instead of the hub", factory=dict)
    n: int = key(32, "samples per problem: mean@n, pass@k, maj@n")
    limit: int | None = key(None, "first N problems of each set; null = all")
    temperature: float = key(1.0, "sampling temperature")
    top_p: float = key(1.0, "nucleus sampling")
    max_tokens: int = key("${rollout.max_tokens}", "response cap")
    template: str = key("${data.template}", "prompt template")
    answer_format: str | None = key(
        "${data.answer_format}", "what the verifier extracts; null = the template's"
    )
    seed: int | None = key(
        "${trainer.seed}",
        "sampling seed of every in-run evaluation (problem i, sample j: seed + i n + j): the same weights "
        "give the same samples, and runs with one trainer.seed draw alike; null = the engines' stream",
    )


@dataclass
class ProbeConfig:
    every: int = key(
        0,
        "every k steps (before the first, at the last) the policy's entropy on fixed base-model texts; 0 = off",
    )
    datasets: list[str] = key("${eval.datasets}", "held-out sets whose prompts the base model answers once")
    paths: dict[str, str] = key("${eval.paths}", "name -> local JSONL instead of the hub")
    limit: int = key(32, "first N problems of each set")
    n: int = key(4, "base-model responses per problem")
    max_tokens: int = key("${rollout.max_tokens}", "response cap of the texts")
    seed: int = key(
        0, "the texts' sampling seed: fixed, so every run from one base model probes the same texts"
    )
    first_n: int = key("${trainer.entropy_first_n}", "probe/entropy_first_n: over each text's first N tokens")


@dataclass
class TrainConfig:
    algorithm: AlgorithmConfig = key(doc="the policy loss", factory=AlgorithmConfig)
    data: DataConfig = key(doc="training data", factory=DataConfig)
    rollout: RolloutConfig = key(doc="rollout engines and sampling", factory=RolloutConfig)
    actor: ActorConfig = key(doc="DeepSpeed actor", factory=ActorConfig)
    trainer: TrainerConfig = key(doc="the run", factory=TrainerConfig)
    eval: TrainEvalConfig = key(doc="held-out evaluation", factory=TrainEvalConfig)
    probe: ProbeConfig = key(doc="fixed-text entropy probe (bandpo.trainer.probe)", factory=ProbeConfig)
    model: ModelConfig = key(doc="the model and its sizes", factory=ModelConfig)
