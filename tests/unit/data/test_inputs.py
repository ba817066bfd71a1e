"""Start-up inputs that cannot be read: one ``InputError`` line naming the key, the file/row or hub id, and
what to give instead. Hub misses are made certain and fast without a network: offline mode on (the
Hub libraries then never try the network) and every Hugging Face cache an empty temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bandpo.data.datasets import load_eval_sets, load_source
from bandpo.errors import HubUnreachable, InputError
from bandpo.hub import hub_error, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
# The eval command needs a few seconds of CPU (imports); on a shared, oversubscribed machine that was 90 s of wall time.
SUBPROCESS_TIMEOUT = 600


@pytest.fixture
def offline_cold_cache(tmp_path, monkeypatch) -> Path:
    """Offline mode and an empty HF_HOME, in this process: the libraries read both at import, so their
    module constants are set too (a subprocess gets the environment variables alone)."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    home = tmp_path / "hf_home"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    return home


def offline_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(home),
    }


def test_eval_set_offline_with_a_cold_cache_names_hub_id_and_local_option(offline_cold_cache):
    with pytest.raises(HubUnreachable) as info:
        load_eval_sets(["amc23"])
    assert str(info.value) == (
        "eval.datasets: dataset amc23 (hub id math-ai/amc23, split test) cannot be loaded: offline mode is on "
        f"(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1) and it is not in the Hugging Face cache ({offline_cold_cache}); "
        "give a local copy with eval.paths.amc23=<file.jsonl> (rows with problem and answer)"
    )


def test_model_offline_with_a_cold_cache_names_the_key_and_local_option(offline_cold_cache):
    with pytest.raises(HubUnreachable) as info:
        load_tokenizer("bandpo-test/no-such-model", "model.path")
    assert str(info.value).startswith(
        "model.path: model bandpo-test/no-such-model (hub id) cannot be loaded: offline mode is on (HF_HUB_OFFLINE=1) "
        f"and it is not in the Hugging Face cache ({offline_cold_cache}); give a local copy with "
        "model.path=<local folder>"
    )


def test_a_warm_hub_cache_is_read_in_offline_mode(offline_cold_cache, tiny_model_dir):
    """A model in the hub cache's layout (models--owner--name/snapshots/<commit>, refs/main) loads by hub id
    with offline mode on: nothing of ours bypasses the libraries' cache."""
    import shutil

    repo = offline_cold_cache / "hub" / "models--bandpo-test--tiny"
    commit = "0" * 40
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    tok = load_tokenizer("bandpo-test/tiny", "model.path")
    assert tok("1+2").input_ids == load_tokenizer(tiny_model_dir, "model.path")("1+2").input_ids


def test_hub_errors_tell_a_connection_failure_from_other_failures(monkeypatch):
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub.errors import LocalEntryNotFoundError

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    try:  # what datasets raises when the Hub has no route: a ConnectionError from the cache miss
        try:
            raise LocalEntryNotFoundError("cannot find the requested files in the disk cache")
        except LocalEntryNotFoundError as e:
            raise ConnectionError("Couldn't reach 'a/b' on the Hub (LocalEntryNotFoundError)") from e
    except ConnectionError as e:
        unreachable = hub_error("dataset a/b", e)
    assert isinstance(unreachable, HubUnreachable)
    assert str(unreachable).startswith(
        "dataset a/b cannot be loaded: the Hub cannot be reached (Couldn't reach "
        "'a/b' on the Hub (LocalEntryNotFoundError)) and it is not in the Hugging "
        "Face cache ("
    )
    assert str(unreachable).endswith("; HF_HUB_OFFLINE=1 reads a warm one without trying the network)")
    # the library's lines joined, cut at 240 characters: 44 of text, 193 dots, "..."
    missing = hub_error(
        "dataset a/b", DatasetNotFoundError("Dataset 'a/b' doesn't exist on the Hub.\n  more" + "." * 300)
    )
    assert type(missing) is InputError
    assert (
        str(missing)
        == "dataset a/b cannot be loaded: Dataset 'a/b' doesn't exist on the Hub. more" + "." * 193 + "..."
    )


def test_a_local_copy_of_a_registered_set_reads_with_its_mapping(tmp_path):
    """``{name, path}``: the file is read as the hub set would be (MATH levels 3-5 kept, its id key)."""
    rows = [
        {"problem": f"p{lvl}", "answer": str(lvl), "level": f"Level {lvl}", "unique_id": f"u{lvl}"}
        for lvl in range(1, 6)
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exs = load_source({"name": "math_l3to5", "path": str(path)})
    assert [(e.id, e.answer, e.source) for e in exs] == [
        ("u3", "3", "math_l3to5"),
        ("u4", "4", "math_l3to5"),
        ("u5", "5", "math_l3to5"),
    ]
    assert [e.id for e in load_source({"name": "math_l3to5", "path": str(path), "limit": 1})] == ["u3"]
    with pytest.raises(InputError, match=r"\['split'\] do not apply to a local file"):
        load_source({"name": "math_l3to5", "path": str(path), "split": "test"})


def test_unreadable_files_are_input_errors_naming_the_file(tmp_path):
    from bandpo.data.datasets import load_local

    cases = {
        "bad.parquet": (b"PAR1 not parquet", r"bad.parquet: cannot read it \(ArrowInvalid: "),
        "rows.json": (b'{"problem": "p"}', r"rows.json: expected a JSON list of rows, got dict"),
        "list.jsonl": (b'{"problem": "p", "answer": "1"}\n[1]\n', r"list.jsonl:2: expected a JSON object"),
        "latin1.jsonl": (
            '{"problem": "\u00e9"}'.encode("latin-1"),
            r"latin1.jsonl: cannot read it "
            r"\(UnicodeDecodeError: ",
        ),
    }
    for name, (content, match) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(InputError, match=match):
            load_local(tmp_path / name)


# ---------------------------------------------------------------- the training entry point: one line, exit 2


def _train_args(tmp_path: Path, model_dir: str, *overrides: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "model.build=null",
        f"trainer.output_dir={tmp_path / 'run'}",
        *overrides,
    ]


def test_train_input_errors_are_one_line_naming_the_key(tmp_path, tiny_model_dir, capsys):
    from bandpo.train import main

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": broken\n')
    cases = [
        (
            ["data=jsonl", "data.train.0.path=/nonexistent.jsonl"],
            "input error: data.train.0.path: dataset file not found: /nonexistent.jsonl",
        ),
        (
            ["data=jsonl", f"data.train.0.path={broken}"],
            f"input error: data.train.0.path: {broken}:2: invalid JSON (Expecting value)",
        ),
        (
            [f"model.path={tmp_path}"],  # a folder without a tokenizer
            f"input error: model.path: model {tmp_path} cannot be loaded: ",
        ),
    ]
    for overrides, expected in cases:
        assert main(_train_args(tmp_path, tiny_model_dir, *overrides)) == 2, overrides
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected), (overrides, err)


def test_train_hub_data_offline_is_one_line_and_exit_2(tmp_path, tiny_model_dir, offline_cold_cache, capsys):
    """``python -m bandpo.train data=dapo_math`` on a machine without the Hub, as the command's ``main`` in
    this process (the data are read before any worker starts); the real process's exit code and stderr
    are checked by tests/unit/config/test_config.py::test_train_sh_fails_fast_on_bad_override."""
    from bandpo.train import main

    assert main(["data=dapo_math", *_train_args(tmp_path, tiny_model_dir)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "input error: data.train.0: dataset dapo17k (hub id BytedTsinghua-SIA/DAPO-Math-17k, split train) cannot be "
        f"loaded: offline mode is on (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1) and it is not in the Hugging Face "
        f"cache ({offline_cold_cache}); give a local copy with data.train.0.path=<file.jsonl|.parquet> (a copy of "
        "that set: its field mapping applies)"
    ]


def test_eval_hub_set_offline_is_one_error_line_and_exit_2(tmp_path):
    """The real command (``python -m bandpo.eval checkpoint=... eval.datasets=[amc23]``) without the Hub: the
    error line comes after the eval's own progress log ("loading ... from the hub"), with no traceback. The
    eval command's one test as a real process (its other user errors run its ``main`` in-process:
    tests/unit/eval/test_eval_checkpoint.py); the offline variables reach the Hub libraries at import."""
    model = tmp_path / "runs" / "x" / "hf"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")  # the datasets are read before the model
    proc = subprocess.run(
        [sys.executable, "-m", "bandpo.eval", "checkpoint=runs/x/hf", "eval.datasets=[amc23]"],
        cwd=tmp_path,
        env=offline_env(tmp_path / "hf"),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
    )
    *logs, last = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last.startswith(
        "eval: error: eval.datasets: dataset amc23 (hub id math-ai/amc23, split test) cannot be "
        "loaded: offline mode is on"
    ) and last.endswith("eval.paths.amc23=<file.jsonl> (rows with problem and answer)"), last
    assert [line.split(" ", 3)[2] for line in logs] == ["INFO"], logs


def test_dapo_math_from_local_copies_keeps_each_sets_mapping(tmp_path, tiny_model_dir):
    """``data=dapo_math`` with ``data.train.<i>.path``: DAPO's rows deduplicated by problem text, MATH's
    filtered to levels 3-5, as the hub sets would be."""
    from bandpo.config import compose
    from bandpo.data.prompts import DAPO_PREFIX, DAPO_SUFFIX
    from bandpo.hub import load_tokenizer
    from bandpo.parts import load_training_prompts

    dapo, math = tmp_path / "dapo.jsonl", tmp_path / "math.jsonl"
    dapo.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": DAPO_PREFIX + p + DAPO_SUFFIX}],
                    "reward_model": {"ground_truth": a},
                    "extra_info": {"index": i},
                }
            )
            + "\n"
            for i, (p, a) in enumerate([("1+1?", "2"), ("1+1?", "2"), ("2+2?", "4")])
        )
    )
    math.write_text(
        "".join(
            json.dumps(
                {"problem": f"p{lvl}", "answer": str(lvl), "level": f"Level {lvl}", "unique_id": f"u{lvl}"}
            )
            + "\n"
            for lvl in (1, 3, 5)
        )
    )
    cfg = compose(
        [
            "data=dapo_math",
            f"data.train.0.path={dapo}",
            f"data.train.1.path={math}",
            f"model.path={tiny_model_dir}",
            "model.build=null",
        ]
    )
    encoded = load_training_prompts(cfg, load_tokenizer(tiny_model_dir, "model.path"))
    assert [(e.id, e.problem, e.answer) for e in encoded.examples] == [
        ("0", "1+1?", "2"),
        ("2", "2+2?", "4"),
        ("u3", "p3", "3"),
        ("u5", "p5", "5"),
    ]
