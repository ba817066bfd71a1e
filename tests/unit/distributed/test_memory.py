"""The plan's per-GPU memory by phase (bandpo.distributed.memory), pinned to hand-computed bytes.

Every figure is exact float64 arithmetic on integers below 2**53 divided by 2**30, so the
tolerance is a relative 1e-12 (rounding of the divisions and sums only).
"""

import json

import pytest

from bandpo.config import compose
from bandpo.distributed.__main__ import main as plan_main
from bandpo.distributed.memory import CUDA_CONTEXT_GIB, VLLM_ASLEEP_GIB, memory_errors, memory_estimate
from bandpo.distributed.plan import ClusterShape, make_plan
from bandpo.train import main as train_main
from tests.helpers.memory import SMALL, estimate

GIB = 2**30


def packed_bf16_activations(H, I, n, L):
    """Bytes per token with gradient checkpointing, bf16 (lp 2), packed attention: each layer's input
    (2 H x L) + one recomputed layer (8H + 9 lp H + 4 lp I + 4n + 8 = 26H + 8I + 4n + 8) + the
    final norm and head (4H + 4 + 2 lp H + 12 = 8H + 16); bandpo.distributed.footprint."""
    return 2 * H * L + (26 * H + 8 * I + 4 * n + 8) + (8 * H + 16)


def test_small_zero2_shape_by_hand():
    # P = 2**30 parameters on W = 2 ranks, H = 1024, I = 2816, 8 heads, L = 4, V = 32768, 8192 packed
    # tokens, chunk 256, checkpointing (the qwen2.5-3b file's).
    est = estimate(SMALL, 16.0)
    P, W, H, I, n, L, V, T, C = 2**30, 2, 1024, 2816, 8, 4, 32768, 8192, 256
    want = {
        "weights": 2 * P,
        "master": 4 * P / W,
        "optimizer": 8 * P / W,
        "grads": 4 * P / W,
        "bucket": 2 * 5e8,
        "head": 12 * C * V + 6 * V * H,
        "activations": T * packed_bf16_activations(H, I, n, L),
    }
    for key, nbytes in want.items():
        assert est.parts[key] == pytest.approx(nbytes / GIB, rel=1e-12), key
    # The optimizer step's fp32 temporary (4 P / W = 2 GiB) outgrows the head and activations (0.78 GiB),
    # which are freed before it: the peak holds the states and the step.
    assert est.parts["optimizer_step"] == pytest.approx(4 * P / W / GIB, rel=1e-12)
    assert "ref_weights" not in est.parts and "live_params" not in est.parts  # kl_coef 0, ZeRO-2
    # 12.93 GiB
    peak = (sum(v for k, v in want.items() if k not in ("head", "activations")) + 4 * P / W) / GIB
    assert est.train == pytest.approx(peak + VLLM_ASLEEP_GIB + 2 * CUDA_CONTEXT_GIB, rel=1e-12)
    # Offload on (colocated default): ZeRO-2 keeps only its reduce bucket during the rollout.
    assert est.offload and est.rollout == pytest.approx(
        1e9 / GIB + 0.5 * 16 + 2 * CUDA_CONTEXT_GIB, rel=1e-12
    )
    assert est.peak == max(est.rollout, est.train) and memory_errors(est) == []


def test_small_shape_without_offload_does_not_fit_and_names_the_keys():
    est = estimate(SMALL + ["actor.offload_during_rollout=false"], 16.0)
    # weights, master, Adam, grads, bucket
    resident = (2 * 2**30 + 2 * 2**30 + 4 * 2**30 + 2 * 2**30 + 1e9) / GIB
    assert est.rollout == pytest.approx(resident + 8.0 + 2 * CUDA_CONTEXT_GIB, rel=1e-12)  # 20.13 GiB > 16
    # Without offload the engines start first and hold their share while the actor builds: the same sum.
    assert est.phase("startup") == est.rollout
    startup, rollout = memory_errors(est)
    assert "startup phase needs 20.1 GiB" in startup and "actor.zero_stage=3" in startup
    assert "rollout phase needs 20.1 GiB" in rollout and "16.0 GiB (trainer.gpu_memory_gib)" in rollout
    assert "rollout.gpu_memory_utilization" in rollout and "actor.offload_during_rollout=true" in rollout


def test_qwen25_7b_on_8_gpus_by_hand():
    # ZeRO-3 over 8 ranks, ref model (kl_coef 0.001), 16384 packed tokens, chunk 512, checkpointing.
    est = estimate(["model=qwen2.5-7b"], 80.0)
    P, W, H, I, n, L, V, T, C = 7615616512, 8, 3584, 18944, 28, 28, 152064, 16384, 512
    want = {
        "weights": 2 * P / W,
        "ref_weights": 2 * P / W,
        "master": 4 * P / W,
        "optimizer": 8 * P / W,
        "grads": 4 * P / W,
        "bucket": 2 * 5e8,
        "live_params": 2 * (V * H + 5e7),
        "head": 12 * C * V + 6 * V * H,
        "activations": T * packed_bf16_activations(H, I, n, L),
    }
    for key, nbytes in want.items():
        assert est.parts[key] == pytest.approx(nbytes / GIB, rel=1e-12), key
    peak = sum(want.values()) / GIB
    assert peak == pytest.approx(30.9231, abs=1e-4)
    assert est.train == pytest.approx(peak + 1.0 + 1.2, rel=1e-12)  # 33.12 GiB
    # Offload on: ZeRO-3 keeps its bf16 weight partition (1.77 GiB) next to vLLM's 0.5 x 80.
    assert est.rollout == pytest.approx(2 * P / W / GIB + 40.0 + 1.2, rel=1e-12)  # 42.97 GiB
    resident = peak - (want["live_params"] + want["head"] + want["activations"]) / GIB  # 18.66 GiB
    assert est.phase("startup") == pytest.approx(resident + 1.0 + 1.2, rel=1e-12)
    # Pinned host memory a rank, each block rounded up to a power of two (bandpo.distributed.host_memory):
    # the fp32 partition P/W = 951,952,064 values (3.81 GB -> 4 GiB), Adam's two (8 GiB), the gradient
    # partition (4 GiB), and the reference's bf16 partitions: a layer's q, o 3.21 MB -> 4 MiB, k, v
    # 0.46 MB -> 512 KiB, gate, up, down 16.97 MB -> 32 MiB, norms 896 B -> 1 KiB (105 MiB + 2 KiB), 28
    # layers, the embedding and lm_head 136 MB -> 256 MiB each, the final norm 1 KiB: 3.3712 GiB.
    ref = (28 * (105 * 2**20 + 2048) + 2 * 2**28 + 1024) / GIB
    assert est.host["node_pinned_gib"] == pytest.approx(8 * (16 + ref), rel=1e-12)  # 154.97 GiB
    assert est.as_json() == {
        "rollout": 42.97,
        "train": 33.12,
        "startup": 20.86,
        "peak": 42.97,
        "capacity": 80.0,
        "host_pinned_per_node": 154.97,
    }


def test_split_layout_reports_actor_and_engine_gpus():
    cfg = compose(
        ["model=qwen2.5-7b", "actor.gpus=4", "rollout.gpus=4", "actor.num_workers=4", "rollout.num_workers=2"]
    )
    est = memory_estimate(cfg, make_plan(cfg, ClusterShape(1, 8), "cuda"), 80.0)
    assert set(est.gpus) == {"actor", "engine"} and not est.offload  # auto: off outside the colocated layout
    assert est.on("engine", "rollout") == est.on("engine", "train") == pytest.approx(40.0 + CUDA_CONTEXT_GIB)
    assert est.on("actor", "train") == pytest.approx(est.parts["actor_peak"] + CUDA_CONTEXT_GIB)


def test_command_json_carries_memory_gib_and_exits_2_when_a_phase_does_not_fit(capsys):
    args = ["--json", "--nodes", "1", "--gpus-per-node", "8", "model=qwen2.5-7b"]
    assert plan_main(args + ["trainer.gpu_memory_gib=80"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_gib"] == {
        "rollout": 42.97,
        "train": 33.12,
        "startup": 20.86,
        "peak": 42.97,
        "capacity": 80.0,
        "host_pinned_per_node": 154.97,  # test_qwen25_7b_on_8_gpus_by_hand
    }
    assert plan_main(args[1:] + ["--gpu-gib", "40", "rollout.gpu_memory_utilization=0.95"]) == 2
    captured = capsys.readouterr()
    assert "rollout phase needs" in captured.err and "(--gpu-gib)" in captured.err
    assert "rollout.gpu_memory_utilization" in captured.err and "colocated GPU: startup" in captured.out


def test_unknown_gpu_memory_is_said_and_not_a_failure(capsys):
    assert plan_main(["--json", "--nodes", "1", "--gpus-per-node", "8", "model=qwen2.5-7b"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_gib"]["capacity"] is None and out["memory_gib"]["rollout"] is None
    assert out["memory_gib"]["train"] == 33.12
    assert plan_main(["--nodes", "1", "--gpus-per-node", "8", "model=qwen2.5-7b"]) == 0
    assert "GPU memory unknown" in capsys.readouterr().out


def test_dry_run_prints_the_same_and_exits_2(capsys):
    base = ["model=qwen2.5-7b", "trainer.dry_run=true", "trainer.nnodes=1", "trainer.gpus_per_node=8"]
    assert train_main(base + ["trainer.gpu_memory_gib=80"]) == 0
    assert "colocated GPU: startup 20.9  rollout 43.0  train 33.1" in capsys.readouterr().out
    # rollout 1.8 + 0.5 x 24 + 1.2 fits; train not
    assert train_main(base + ["trainer.gpu_memory_gib=24"]) == 2
    err = capsys.readouterr().err
    assert "train phase needs 33.1 GiB" in err and "actor.max_tokens_per_micro_batch" in err
