"""actor.bf16 / model.dtype resolution: the CPU's bf16 detection from /proc/cpuinfo texts, auto vs explicit."""

from __future__ import annotations

import pytest

from bandpo.distributed import precision
from bandpo.distributed.precision import (
    check_old_logprobs_dtype,
    cpu_has_fast_bf16,
    engine_dtype,
    resolve_bf16,
)
from bandpo.errors import ConfigError


def cpuinfo(*flag_lines: str) -> str:
    """A /proc/cpuinfo text with one processor block per ``flags`` line, as Linux writes it."""
    return "\n".join(
        f"processor\t: {i}\nvendor_id\t: AuthenticAMD\nmodel name\t: test cpu\nflags\t\t: {flags}\n"
        for i, flags in enumerate(flag_lines)
    )


ZEN3 = "fpu vme sse sse2 avx avx2 fma bmi2 sha_ni vaes vpclmulqdq"  # no AVX-512 at all
ZEN4 = "fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni avx512vl"
SAPPHIRE_RAPIDS = "fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
AMX_ONLY = "fpu sse2 avx2 avx512f amx_bf16 amx_tile"
ICE_LAKE = "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bitalg"  # AVX-512 without its bf16 extension


@pytest.mark.parametrize(
    "text, fast",
    [
        (cpuinfo(ZEN3, ZEN3), False),
        (cpuinfo(ICE_LAKE), False),
        (cpuinfo(ZEN4, ZEN4), True),
        (cpuinfo(SAPPHIRE_RAPIDS), True),
        (cpuinfo(AMX_ONLY), True),
        (cpuinfo(ZEN4, ZEN3), False),  # one processor would run its share emulated
        # ARM lists "Features" (with "bf16" on some cores), never an x86 "flags" line: not detected
        ("processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU implementer\t: 0x41\n", False),
        ("", False),
    ],
)
def test_fast_bf16_is_read_from_every_processors_flags(text, fast):
    assert cpu_has_fast_bf16(text, system="Linux") is fast


def test_a_flag_is_a_whole_word_not_a_substring():
    assert cpu_has_fast_bf16(cpuinfo("fpu avx512_bf16x amx_bf16_foo"), system="Linux") is False


def test_other_operating_systems_have_no_detection():
    assert cpu_has_fast_bf16(cpuinfo(SAPPHIRE_RAPIDS), system="Darwin") is False
    assert cpu_has_fast_bf16(cpuinfo(SAPPHIRE_RAPIDS), system="Windows") is False


def test_an_unreadable_cpuinfo_is_an_error_naming_the_key(monkeypatch, tmp_path):
    monkeypatch.setattr(precision, "CPUINFO", tmp_path / "missing")
    with pytest.raises(
        OSError, match="actor.bf16=auto reads the CPU's flags from .*missing.*set actor.bf16=true or false"
    ):
        cpu_has_fast_bf16(system="Linux")


def test_this_machines_answer_matches_its_flags():
    try:
        text = precision.CPUINFO.read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    flags = [set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")]
    expected = bool(flags) and all({"avx512_bf16", "amx_bf16"} & f for f in flags)
    assert cpu_has_fast_bf16(system="Linux") is expected


@pytest.mark.parametrize(
    "setting, device, fast, bf16",
    [
        ("auto", "cuda", False, True),
        ("auto", "cpu", True, True),
        ("auto", "cpu", False, False),
        (True, "cpu", False, True),  # explicit wins over the detection, both ways
        (False, "cpu", True, False),
        (False, "cuda", True, False),
    ],
)
def test_auto_follows_the_device_and_explicit_values_win(setting, device, fast, bf16):
    assert resolve_bf16(setting, device, fast_cpu_bf16=fast) is bf16


def test_auto_on_cpu_asks_the_detection(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    assert resolve_bf16("auto", "cpu") is True
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert resolve_bf16("auto", "cpu") is False


@pytest.mark.parametrize("bad", ["yes", "bf16", 1, 0, None])
def test_bad_bf16_values_name_the_key(bad):
    with pytest.raises(ConfigError, match="actor.bf16 must be one of auto, true, false"):
        resolve_bf16(bad, "cpu", fast_cpu_bf16=False)


def test_engine_dtype_follows_the_actor_unless_model_dtype_names_one():
    assert engine_dtype("auto", True) == "bfloat16"
    assert engine_dtype("auto", False) == "float32"
    assert engine_dtype("float32", True) == "float32"
    assert engine_dtype("bfloat16", False) == "bfloat16"
    with pytest.raises(
        ConfigError, match="model.dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"
    ):
        engine_dtype("fp8", True)


@pytest.mark.parametrize(
    "bf16_setting, model_dtype, bf16",
    [("auto", "auto", True), ("auto", "auto", False), (True, "bfloat16", True), (False, "float32", False)],
)
def test_old_logprobs_from_rollout_takes_engines_in_the_actors_dtype(bf16_setting, model_dtype, bf16):
    check_old_logprobs_dtype("rollout", bf16_setting, model_dtype, bf16, engine_dtype(model_dtype, bf16))


@pytest.mark.parametrize(
    "bf16_setting, model_dtype, bf16, actor, engines",
    [
        (True, "float32", True, "bfloat16", "float32"),
        ("auto", "float16", True, "bfloat16", "float16"),
        (False, "bfloat16", False, "float32", "bfloat16"),
        ("auto", "float16", False, "float32", "float16"),
    ],
)
def test_old_logprobs_from_rollout_refuses_another_engine_dtype_naming_the_keys(
    bf16_setting, model_dtype, bf16, actor, engines
):
    with pytest.raises(ConfigError) as e:
        check_old_logprobs_dtype("rollout", bf16_setting, model_dtype, bf16, engines)
    for part in (
        "actor.old_logprobs=rollout",
        f"actor.bf16={bf16_setting}",
        f"model.dtype={model_dtype}",
        f"actor computes in {actor}",
        f"engines in {engines}",
    ):
        assert part in str(e.value), (part, str(e.value))
    check_old_logprobs_dtype(
        "recompute", bf16_setting, model_dtype, bf16, engines
    )  # the actor's own pi_old: any


def test_cpu_name_is_the_first_model_name_line(monkeypatch):
    text = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: avx2\n\nprocessor\t: 1\nmodel name\t: other\n"
    assert precision.cpu_name(text) == "AMD EPYC 9R14"
    monkeypatch.setattr(precision.platform, "processor", lambda: "")
    assert precision.cpu_name("processor\t: 0\n") == "unknown CPU"
