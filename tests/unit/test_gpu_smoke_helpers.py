"""The GPU smoke test's arithmetic (``bandpo.tools.gpu_smoke``): its peak table; MFU, the bf16 / fp32
log-prob tolerance and the shared-prompt batch of its checks."""

import math

import pytest

from bandpo.tools.gpu_smoke import checks
from bandpo.tools.gpu_smoke import cli as smoke


def test_peak_by_exact_device_name():
    # dense bf16 = half the datasheets' with-sparsity figures: H100 SXM 1,979, PCIe 1,513, NVL 1,671 TFLOP/s
    assert smoke.peak_flops("NVIDIA H100 80GB HBM3") == 989.5e12
    assert smoke.peak_flops("NVIDIA H100 PCIe") == 756.5e12
    assert smoke.peak_flops("NVIDIA H100 NVL") == 835.5e12
    assert smoke.peak_flops("NVIDIA H200") == 989.5e12
    assert smoke.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert smoke.peak_flops("NVIDIA L40S") == 362.05e12
    # no substring guesses: an H100 PCIe is not an H100 SXM, an unknown card has no peak
    assert smoke.peak_flops("NVIDIA H100") is None
    assert smoke.peak_flops("cpu") is None


def test_groups_share_one_prompt():
    rb = checks.random_batch(8, 16, 24, 512)
    prompts, responses, _ = rb.to_lists()
    assert prompts[0] == prompts[3] != prompts[4] == prompts[7]  # two groups of GROUP = 4
    assert len({tuple(r) for r in responses}) == 8
    assert checks.computed_tokens(rb) == len(prompts[0]) + len(prompts[4]) + sum(map(len, responses))


def test_mfu_is_six_params_tokens_over_time_and_peak():
    # 1.5e9 params x 10,000 tokens x 6 = 9e13 FLOP in 0.2 s = 4.5e14 FLOP/s of 989e12
    assert checks.mfu(1_500_000_000, 10_000, 0.2, 989e12) == pytest.approx(4.5e14 / 989e12, rel=1e-12)
    assert checks.mfu(1, 1, 1.0, None) is None


def test_logprob_tolerance_follows_the_unit_roundoff():
    # bf16: 2 * 2^-8 * (1 + 9) * sqrt(2 * 28) = 0.5846...; fp32 adds sqrt(H) to 2^-24's bound
    assert checks.logprob_tolerance("bfloat16", 9.0, 28, 1536) == pytest.approx(
        2 * 2**-8 * 10 * math.sqrt(56)
    )
    assert checks.logprob_tolerance("float32", 9.0, 28, 1536) == pytest.approx(
        2 * 2**-24 * 10 * math.sqrt(56) * math.sqrt(1536)
    )
