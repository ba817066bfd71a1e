"""Fast checks of what keeps a run recoverable: atomic run checkpoints (full disk, corrupt
files, killed writes), the metrics log on resume, and the NaN/inf guards. No engines."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from bandpo.checkpoint.run_folders import CheckpointManager
from bandpo.run.metrics_log import MetricsLogger
from bandpo.run.nonfinite import NonfiniteGuard, first_nonfinite
from bandpo.types import RolloutBatch, TrainBatch


def _write_actor(folder):
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 64)


def _save(mgr: CheckpointManager, step: int):
    return mgr.save(step, _write_actor, {"step": step, "sampler": {"epoch": 0}})


# ---------------------------------------------------------------- run checkpoints
def test_save_publishes_complete_folders_and_keeps_the_last_k(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    assert mgr.latest() is None
    for step in (1, 2, 3):
        _save(mgr, step)
    assert sorted(p.name for p in mgr.root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert mgr.latest() == mgr.root / "step_000003"
    assert mgr.load_state(mgr.latest()) == {"step": 3, "sampler": {"epoch": 0}}


def test_disk_full_while_checkpointing_keeps_the_previous_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    _save(mgr, 1)

    def disk_full(folder):
        folder.mkdir()
        (folder / "part.bin").write_bytes(b"x" * 16)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as err:
        mgr.save(2, disk_full, {"step": 2})
    assert err.value.errno == errno.ENOSPC
    assert mgr.latest() == mgr.root / "step_000001"
    assert not list(mgr.root.glob(".tmp-*"))  # the failed write's folder is gone at once
    assert not (mgr.root / "step_000002").exists()
    _save(mgr, 2)  # space freed: the next save works
    assert mgr.latest() == mgr.root / "step_000002"


def test_killed_write_is_never_picked_up_and_is_removed(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    _save(mgr, 1)
    killed = mgr.root / ".tmp-step_000002-99999"  # what a SIGKILL mid-save leaves
    (killed / "actor").mkdir(parents=True)
    (killed / "trainer_state.json").write_text('{"step": 2, "sampler"')
    (mgr.root / ".latest.tmp-99999").write_text("step_0000")  # killed while the pointer was written
    assert mgr.latest() == mgr.root / "step_000001"
    mgr.remove_stale()  # the trainer does this on resume; save() does it too
    assert not killed.exists() and not (mgr.root / ".latest.tmp-99999").exists()
    (killed / "actor").mkdir(parents=True)
    _save(mgr, 2)
    assert not killed.exists() and mgr.latest() == mgr.root / "step_000002"


def test_kill_between_rename_and_pointer_falls_back_to_newest_folder(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    _save(mgr, 1)
    _save(mgr, 2)
    (mgr.root / "latest").unlink()
    assert mgr.latest() == mgr.root / "step_000002"
    _save(mgr, 2)  # the step is redone and saved again over the folder
    assert mgr.latest() == mgr.root / "step_000002"


def test_corrupt_checkpoint_errors_name_the_file(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    folder = _save(mgr, 1)
    (mgr.root / "latest").write_text("step_000007")
    with pytest.raises(RuntimeError, match=r"latest names 'step_000007'"):
        mgr.latest()
    (mgr.root / "latest").write_text("../../etc")
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        mgr.latest()
    state = folder / "trainer_state.json"
    state.write_text('{"step": 1, "samp')
    with pytest.raises(RuntimeError, match=f"corrupt checkpoint: {state} is unreadable"):
        mgr.load_state(folder)
    state.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RuntimeError, match="trainer_state.json is unreadable"):
        mgr.load_state(folder)
    state.write_text('{"step": 1}')
    with pytest.raises(RuntimeError, match="trainer_state.json lacks sampler"):
        mgr.load_state(folder, required=("step", "sampler"))


def test_corrupt_actor_file_is_named(tmp_path):
    from bandpo.checkpoint.actor_state import load_rng, raise_naming_unreadable_file, save_rng

    save_rng(tmp_path, 0)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    raise_naming_unreadable_file(tmp_path, ValueError("x"))  # all readable: returns
    data = (tmp_path / "rng_rank0.pt").read_bytes()
    (tmp_path / "rng_rank0.pt").write_bytes(data[: len(data) // 2])  # truncated by a crash
    with pytest.raises(RuntimeError, match=r"corrupt checkpoint: .*rng_rank0\.pt is unreadable"):
        load_rng(tmp_path, 0)
    with pytest.raises(RuntimeError, match=r"rng_rank0\.pt is unreadable"):
        raise_naming_unreadable_file(tmp_path, ValueError("x"))


# ---------------------------------------------------------------- metrics log on resume
def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_truncation_drops_what_a_resume_writes_again(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3)
    log.log(0, {"eval/x": 1.0})
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": float(step)})
    log.log(3, {"final": True, "eval/x": 2.0})
    with open(log.path, "a") as fh:
        fh.write('{"step": 4, "reward/me')  # torn by a kill mid-write
    log.truncate_after(2)
    assert [(r["step"], r.get("final", False)) for r in _lines(log.path)] == [
        (0, False),
        (1, False),
        (2, False),
    ]
    log.truncate_after(-1)  # a fresh start (no checkpoint to resume from)
    assert log.path.read_text() == ""


def test_nonfinite_metrics_are_logged_as_strings(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=1)
    log.log(1, {"actor/loss": float("nan"), "actor/grad_norm": torch.tensor(float("inf"))})
    assert _lines(log.path) == [{"step": 1, "actor/loss": "nan", "actor/grad_norm": "inf"}]


# ---------------------------------------------------------------- NaN/inf guards
def _batch() -> TrainBatch:
    rb = RolloutBatch.from_lists(
        [[5, 6], [7]], [[1, 2, 3], [4]], [[-1.0] * 3, [-1.0]], [0, 0], ["stop"] * 2, 0
    )
    return TrainBatch.from_rollout(
        rb,
        rewards=torch.tensor([1.0, -1.0]),
        advantages=torch.tensor([1.0, -1.0]),
        old_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]]),
    )


@pytest.mark.parametrize(
    "name,value",
    [
        ("rewards", float("nan")),
        ("old_logprobs", float("-inf")),
        ("ref_logprobs", float("nan")),
        ("advantages", float("inf")),
    ],
)
def test_first_nonfinite_names_the_tensor(name, value):
    batch = _batch()
    assert first_nonfinite(batch) == ""
    batch.ref_logprobs = batch.old_logprobs.clone()
    t = getattr(batch, name)
    t[(0, 1) if t.dim() == 2 else 0] = value
    assert first_nonfinite(batch) == name


def test_padding_counts_only_when_unmasked():
    batch = _batch()
    batch.old_logprobs[1, 2] = float("nan")  # a padding position
    assert first_nonfinite(batch) == ""  # the trainer's view: no response token is affected
    assert first_nonfinite(batch, masked=False) == "old_logprobs"  # the actor's: NaN * 0 is NaN


def test_guard_skips_and_counts_then_stops(capsys):
    guard = NonfiniteGuard("skip", max_skipped=2)
    assert guard.check(1, "") is False and guard.skipped == 0
    assert guard.check(2, "rewards") is True and guard.skipped == 1
    assert "step 2: non-finite values (NaN/inf) in rewards; update skipped" in capsys.readouterr().out
    assert guard.check(3, "loss") is True
    with pytest.raises(
        FloatingPointError, match=r"step 4: .* in old_logprobs; stopping after 3 skipped steps"
    ):
        guard.check(4, "old_logprobs")
    with pytest.raises(FloatingPointError, match=r"in loss; stopping \(trainer.on_nonfinite=stop\)"):
        NonfiniteGuard("stop").check(1, "loss")
    with pytest.raises(ValueError, match="on_nonfinite"):
        NonfiniteGuard("ignore")


def test_stale_weight_buffers_of_dead_drivers_are_removed():
    from bandpo.shm.weight_files import SHM_PREFIX, remove_stale_weight_files

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    # One file per Ray node: <pid>-<node id>.bin (and the single-file name of earlier versions).
    dead_pid = dead.stdout.strip()
    stale, stale_node = f"{SHM_PREFIX}{dead_pid}.bin", f"{SHM_PREFIX}{dead_pid}-0f3a9c.bin"
    live = f"{SHM_PREFIX}{os.getpid()}-0f3a9c.bin"
    for path in (stale, stale_node, live):
        with open(path, "wb") as fh:
            fh.write(b"\0" * 8)
    try:
        assert {stale, stale_node} <= set(remove_stale_weight_files())
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, stale_node, live):
            if os.path.exists(path):
                os.unlink(path)


# ---------------------------------------------------------------- the fault test's own parts
def _run_dir(root, steps, loss=0.5, weights=1.0):
    from safetensors.torch import save_file

    (root / "hf").mkdir(parents=True)
    save_file({"w": torch.full((3,), weights)}, root / "hf" / "model.safetensors")
    root.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": -1.0, "actor/loss": loss * s}) + "\n" for s in steps)
    )
    mgr = CheckpointManager(root / "checkpoints")
    mgr.save(max(steps), lambda folder: (folder / "state").mkdir(parents=True), {"step": max(steps)})
    return root


def test_fault_checks_pass_on_equal_runs_and_name_each_violation(tmp_path):
    from bandpo.tools.fault_test import checks

    ref = _run_dir(tmp_path / "ref", [1, 2, 3])
    ok = _run_dir(tmp_path / "ok", [1, 2, 3])
    rows, ref_rows = checks.read_metrics(ok), checks.read_metrics(ref)
    assert checks.check_steps(rows, ref_rows, 3) == []
    assert checks.check_step_metrics(rows, ref_rows) == []
    assert checks.check_weights(ok, ref) == ([], 0.0)
    assert checks.check_latest(ok) == ([], "step_000003")
    assert checks.leftovers(ok) == []

    dup = _run_dir(tmp_path / "dup", [1, 2, 2, 3], loss=0.6, weights=1.1)
    rows = checks.read_metrics(dup)
    assert "training steps are [1, 2, 2, 3]" in checks.check_steps(rows, ref_rows, 3)[0]
    assert "step 1: actor/loss = 0.6 after kills, 0.5 uninterrupted" in checks.check_step_metrics(
        rows, ref_rows
    )
    problems, diff = checks.check_weights(dup, ref)
    assert diff == pytest.approx(0.1) and "differ" in problems[0]
    (dup / "checkpoints" / ".tmp-step_000004-1").mkdir()
    (dup / "hf.tmp").mkdir()
    assert checks.leftovers(dup) == ["left behind: checkpoints/.tmp-step_000004-1", "left behind: hf.tmp"]
    (dup / "checkpoints" / "latest").write_text(".tmp-step_000004-1")
    assert "not a step folder" in checks.check_latest(dup)[0][0]


def test_session_kill_reaches_processes_that_left_the_process_group(tmp_path):
    """Ray puts its workers in their own process groups (same session): killpg alone misses them."""
    from bandpo.tools.fault_test.process import Session

    moved = "import os, time; os.setpgid(0, 0); print('moved', flush=True); time.sleep(300)"
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {moved!r}])\n"
        "subprocess.Popen(['sleep', '300'])\n"
        "time.sleep(300)\n"
    )
    session = Session([sys.executable, "-c", script], tmp_path / "log", tmp_path, dict(os.environ))
    while "moved" not in (tmp_path / "log").read_text() or len(session.members()) < 3:
        assert session.poll() is None
        time.sleep(0.05)
    members = session.members()
    assert len({os.getpgid(p.pid) for p in members}) == 2  # one left the leader's group
    assert session.kill() == []
    assert session.members() == [] and session.poll() == -9


def test_fault_test_refuses_overrides_it_owns(tmp_path):
    from bandpo.tools.fault_test.__main__ import main

    assert main(["--out", str(tmp_path), "trainer.output_dir=/x"]) == 2
    assert main(["--out", str(tmp_path), "--kills", "0"]) == 2


def test_fault_test_runs_the_repository_train_script():
    # The harness lives three folders down (bandpo/tools/fault_test/); it drives scripts/train.sh from the root.
    from bandpo.tools.fault_test import runner

    assert (runner.ROOT / runner.TRAIN[1]).is_file() and (runner.ROOT / "pyproject.toml").is_file()
