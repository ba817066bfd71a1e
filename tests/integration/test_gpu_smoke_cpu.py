"""scripts/gpu_smoke.py --cpu: the smoke script's CPU-capable parts (DeepSpeed ZeRO-2 and ZeRO-3 on one
rank, the packed path against the padded reference) on a tiny model, in-process."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_gpu_smoke_cpu_mode(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_smoke", Path(__file__).resolve().parents[2] / "scripts/gpu_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    out = tmp_path / "smoke.json"
    result = smoke.main(["--cpu", "--rows", "4", "--workdir", str(tmp_path / "models"), "--out", str(out)])
    assert json.loads(out.read_text())["meta"]["device"] == "cpu"
    assert [r["zero_stage"] for r in result["stages"]] == [2, 3]
    for r in result["stages"]:
        assert r["packed_ok"], r  # within the fp32 bound of logprob_tolerance
        assert r["tokens_per_s"] > 0 and r["mfu"] is None  # no peak for a CPU
    assert result["ipc"] is None
