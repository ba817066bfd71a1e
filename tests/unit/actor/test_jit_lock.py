"""bandpo.actor.jit_lock: a killed build's lock is an error naming the file, not a rank hung for ever."""

import os
import threading

import pytest

from bandpo.actor.jit_lock import build_lock, wait_for_build


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def test_the_lock_is_in_torch_s_build_folder_for_the_op(extensions):
    lock = build_lock("some_op")
    assert lock.name == "lock" and lock.parent.name == "some_op" and extensions in lock.parents


def test_no_lock_returns_at_once(extensions):
    wait_for_build("some_op", timeout_s=0.0)


def test_a_lock_that_goes_away_is_waited_for(extensions):
    lock = build_lock("some_op")
    lock.touch()
    threading.Timer(0.2, lock.unlink).start()  # another rank's build ending
    wait_for_build("some_op", timeout_s=30.0, poll_s=0.05)
    assert not lock.exists()


def test_a_lock_that_outlives_any_build_names_the_file(extensions):
    lock = build_lock("some_op")
    lock.touch()
    ticks = iter([0.0, 1.0, 5.0])  # a fake clock: the limit passes on the third look
    with pytest.raises(RuntimeError, match=rf"{lock}.*killed midway"):
        wait_for_build("some_op", timeout_s=4.0, poll_s=0.0, clock=lambda: next(ticks))
    assert lock.exists()  # named, not removed: the file is the user's to check


def test_builds_one_after_another_restart_the_wait(extensions):
    """Each new lock (another process's build) is a new file: only one lock left alone times out."""
    lock = build_lock("some_op")
    lock.touch()
    clock = iter(range(100))  # 1 s a look; the limit is 3 s

    def tick():
        t = next(clock)
        if t in (2, 4):  # a build ends and the next starts: a new lock file
            lock.unlink()
            lock.touch()
            os.utime(lock, ns=(t * 10**9, t * 10**9))
        return float(t)

    with pytest.raises(RuntimeError, match="killed midway"):
        wait_for_build("some_op", timeout_s=3.0, poll_s=0.0, clock=tick)
    assert next(clock) >= 8  # it waited past two new locks before the third one outlived the limit
