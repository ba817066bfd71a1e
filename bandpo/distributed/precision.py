"""The actor's compute precision (``actor.bf16``) and the rollout engines' dtype that follows it.

``actor.bf16``: ``auto`` | ``true`` | ``false``.
    auto   bf16 on GPU; on CPU bf16 only where the processor multiplies bf16 in hardware
           (``cpu_has_fast_bf16``), else fp32. Without that hardware PyTorch's CPU GEMMs
           emulate bf16 (measured on an AMD Zen 3: 0.27 against 46 GFLOP/s in fp32), while
           with AMX they ran 2.6-4.2x faster than fp32 (an Intel Xeon; docs/configuration.md, Precision).
    true / false  as given, on any device (an explicit choice wins over the detection).
bf16 means DeepSpeed's bf16 mode: bf16 weights and activations, fp32 master weights, fp32
gradient accumulation (``bandpo.actor.ds_config``).

``model.dtype``: the rollout engines' dtype. ``auto`` = the actor's resolved precision
(``bfloat16`` / ``float32``), so the engines sample with the numerics the actor scores with
(a mismatch shows up as pi_old / pi_rollout != 1: ``bandpo.algo.mismatch``). An explicit
``float32`` / ``bfloat16`` / ``float16`` is used as given.

The detection runs where ``auto`` is resolved: the driver (``bandpo.trainer.launch``). A
cluster whose actor nodes have other CPUs than the driver's sets ``actor.bf16`` explicitly.

Pure Python: no torch (the placement plan's memory arithmetic uses it too).
"""

from __future__ import annotations

import platform
from pathlib import Path

from bandpo.errors import ConfigError

CPUINFO = Path("/proc/cpuinfo")
# x86 feature flags of native bf16 arithmetic as Linux lists them: AVX512-BF16 dot products
# (AMD Zen 4/5, Intel Cooper Lake and Sapphire Rapids on) and AMX's bf16 tile multiply (Intel
# Sapphire Rapids on). oneDNN, behind PyTorch's CPU GEMMs, uses either.
FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_CHOICES = ("auto", True, False)
ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def cpu_name(cpuinfo: str | None = None) -> str:
    """The processor's model name, as benchmarks and build reports print it: the first ``model name``
    line of ``/proc/cpuinfo`` (``cpuinfo`` replaces the file's text), else ``platform.processor()``,
    else "unknown CPU"."""
    try:
        text = CPUINFO.read_text() if cpuinfo is None else cpuinfo
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def cpu_has_fast_bf16(cpuinfo: str | None = None, system: str | None = None) -> bool:
    """Whether this machine's CPU multiplies bf16 in hardware.

    Detected on Linux from ``/proc/cpuinfo``: every processor's ``flags`` line must list
    ``avx512_bf16`` or ``amx_bf16`` (a processor without them would run its share emulated).
    Other operating systems (no ``/proc/cpuinfo``), and Linux CPUs that list no x86 ``flags``
    line (ARM lists ``Features``), give False: fp32 there, where ``actor.bf16=true`` still
    asks for bf16. ``cpuinfo`` / ``system`` replace the file's text and ``platform.system()``
    (tests). An unreadable ``/proc/cpuinfo`` on Linux raises OSError naming ``actor.bf16``.
    """
    if (system or platform.system()) != "Linux":
        return False
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError as e:
            raise OSError(
                f"actor.bf16=auto reads the CPU's flags from {CPUINFO}, which is unreadable ({e}); "
                "set actor.bf16=true or false"
            ) from e
    flag_sets = [
        set(value.split())
        for key, _, value in (line.partition(":") for line in cpuinfo.splitlines())
        if key.strip() == "flags"
    ]
    return bool(flag_sets) and all(flags.intersection(FAST_BF16_FLAGS) for flags in flag_sets)


def resolve_bf16(setting, device: str, fast_cpu_bf16: bool | None = None) -> bool:
    """``actor.bf16`` (auto / true / false) on ``device`` ("cuda" or "cpu") -> whether the actor computes
    in bf16 (module docstring). ``fast_cpu_bf16`` replaces the CPU detection (tests)."""
    check_bf16(setting)
    if setting != "auto":
        return bool(setting)
    if device == "cuda":
        return True
    return cpu_has_fast_bf16() if fast_cpu_bf16 is None else fast_cpu_bf16


def engine_dtype(model_dtype, bf16: bool) -> str:
    """The rollout engines' dtype: ``model.dtype``, its ``auto`` being the actor's precision ``bf16``."""
    check_engine_dtype(model_dtype)
    if model_dtype == "auto":
        return "bfloat16" if bf16 else "float32"
    return model_dtype


def check_old_logprobs_dtype(old_logprobs: str, bf16_setting, model_dtype, bf16: bool, engines: str) -> None:
    """``actor.old_logprobs=rollout`` takes pi_old from the engines' sampling log-probs, which differ from
    the actor's only by kernel noise when both compute in one dtype; engines in another dtype than the
    actor's (``bf16``: ``actor.bf16`` resolved) would add that precision gap to every ratio, so that is a
    ``ConfigError`` naming the three keys. The start-up calls it once the device is known, with the run's
    resolved ``engines`` dtype (``engine_dtype``: ``bandpo.parts.RunPlan.engine_dtype``)."""
    if old_logprobs != "rollout":
        return
    actor = "bfloat16" if bf16 else "float32"
    if engines != actor:
        raise ConfigError(
            f"config error: actor.old_logprobs=rollout needs the engines to sample in the actor's dtype, "
            f"but the actor computes in {actor} (actor.bf16={bf16_setting}) and the engines in {engines} "
            f"(model.dtype={model_dtype}); set model.dtype=auto, or actor.old_logprobs=recompute"
        )


def check_bf16(setting) -> None:
    """``actor.bf16`` is auto, true or false (config validation and ``resolve_bf16``); a bare 1 / 0
    would pass a membership test as True / False, so the type is checked too."""
    if setting not in BF16_CHOICES or not isinstance(setting, (str, bool)):
        raise ConfigError(f"config error: actor.bf16 must be one of auto, true, false, got {setting!r}")


def check_engine_dtype(model_dtype) -> None:
    """``model.dtype`` is one of ``ENGINE_DTYPES`` (config validation and ``engine_dtype``)."""
    if model_dtype not in ENGINE_DTYPES:
        raise ConfigError(
            f"config error: model.dtype must be one of {', '.join(ENGINE_DTYPES)}, got {model_dtype!r}"
        )
