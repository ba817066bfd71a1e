"""Loaded by every Python process of a ``benchmarks.first_command --emulate-avx2`` run (this folder is
put first on PYTHONPATH): torch's CPU checks answer as an AVX2-only CPU's would, so vLLM loads its
AVX2 kernels and picks its AVX2 paths. With ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and
MKL_ENABLE_INSTRUCTIONS (set by the benchmark) torch, oneDNN and MKL run AVX2 code too. The clock,
caches and cores stay this machine's: an estimate of the kernels' share, not an AVX2 machine."""

import os

if os.environ.get("BANDPO_EMULATE_AVX2") == "1":
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
