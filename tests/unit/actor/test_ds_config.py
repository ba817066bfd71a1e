"""The actor's DeepSpeed config as DeepSpeed 0.19's own parser and engine read it (no engine built)."""

from types import SimpleNamespace

import pytest
import torch

from bandpo.actor.ds_config import build_ds_config


def _resolved_dtypes(config: dict) -> tuple[torch.dtype, torch.dtype]:
    """(model dtype, gradient-accumulation dtype) as ``DeepSpeedEngine.get_data_types`` decides them."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    parsed = DeepSpeedConfig(config)
    engine = SimpleNamespace(
        _config=parsed, fp16_enabled=lambda: False, bfloat16_enabled=lambda: parsed.bfloat16_config.enabled
    )
    return DeepSpeedEngine.get_data_types(engine)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_gpu_config_accumulates_bf16_gradients_in_fp32(zero_stage):
    config = build_ds_config(
        zero_stage=zero_stage, micro_batch_size=1, grad_accum=32, world_size=1, grad_clip=1.0, bf16=True
    )
    # world_size 1: without a process group DeepSpeedConfig checks the batch sizes against one rank
    print(config)  # the GPU config, as the actor hands it to deepspeed.initialize
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert _resolved_dtypes(config) == (torch.bfloat16, torch.float32)


def test_cpu_config_stays_fp32_without_a_data_types_section():
    config = build_ds_config(
        zero_stage=2, micro_batch_size=1, grad_accum=4, world_size=1, grad_clip=1.0, bf16=False
    )
    assert "data_types" not in config
    assert _resolved_dtypes(config) == (torch.float32, torch.float32)
