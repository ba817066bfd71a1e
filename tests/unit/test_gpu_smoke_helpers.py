"""scripts/gpu_smoke.py's arithmetic: the peak table, MFU and the bf16 / fp32 log-prob tolerance."""

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_smoke", Path(__file__).resolve().parents[2] / "scripts/gpu_smoke.py")
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)


def test_peak_by_device_name():
    assert smoke.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert smoke.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert smoke.peak_flops("cpu") is None


def test_mfu_is_six_params_tokens_over_time_and_peak():
    # 1.5e9 params x 10,000 tokens x 6 = 9e13 FLOP in 0.2 s = 4.5e14 FLOP/s of 989e12
    assert smoke.mfu(1_500_000_000, 10_000, 0.2, 989e12) == pytest.approx(4.5e14 / 989e12, rel=1e-12)
    assert smoke.mfu(1, 1, 1.0, None) is None


def test_logprob_tolerance_follows_the_unit_roundoff():
    # bf16: 2 * 2^-8 * (1 + 9) * sqrt(2 * 28) = 0.5846...; fp32 adds sqrt(H) to 2^-24's bound
    assert smoke.logprob_tolerance("bfloat16", 9.0, 28, 1536) == pytest.approx(2 * 2**-8 * 10 * math.sqrt(56))
    assert smoke.logprob_tolerance("float32", 9.0, 28, 1536) == pytest.approx(2 * 2**-24 * 10 * math.sqrt(56)
                                                                               * math.sqrt(1536))
