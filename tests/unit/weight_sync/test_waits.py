"""Bounded waits of the GPU weight sync (``bandpo.weight_sync.waits``): a wait that never ends becomes
an error naming its stage, after the (tiny) limit; a failure ends a wait at once. No Ray: its
``wait`` is faked as one that never sees a result (tests/integration/weight_sync/test_sync_timeouts.py
runs the same on real Ray actors). No timed assertions: the limits are what end the tests."""

import sys
import threading
import types

import pytest

from bandpo.errors import WeightSyncTimeout, WorkerFailure
from bandpo.weight_sync.waits import InThread, get_within, run_within


def _never_ready_ray(monkeypatch, seen=None):
    def wait(pending, num_returns, timeout):
        threading.Event().wait(timeout)  # nothing arrives within the time asked for
        return [], pending

    monkeypatch.setitem(
        sys.modules, "ray", types.SimpleNamespace(wait=wait, get=lambda refs, timeout=None: refs)
    )


def test_a_get_that_never_returns_is_an_error_naming_the_stage(monkeypatch):
    _never_ready_ray(monkeypatch)
    with pytest.raises(WeightSyncTimeout) as e:
        get_within(["ref"], 0.05, "NCCL rendezvous", "check NCCL_SOCKET_IFNAME")
    assert (
        str(e.value) == "weight sync: NCCL rendezvous did not finish within 0.05 s (check NCCL_SOCKET_IFNAME)"
    )
    assert isinstance(e.value, WorkerFailure)  # the trainer's stage handling reports it like a dead worker


def test_a_blocking_call_of_this_process_is_bounded_too():
    stuck = threading.Event()  # never set: a NCCL init waiting for peers that never come
    with pytest.raises(
        WeightSyncTimeout, match="NCCL rendezvous \\(actor rank 0\\) did not finish within 0.05 s"
    ):
        run_within(stuck.wait, 0.05, "NCCL rendezvous (actor rank 0)")
    assert run_within(lambda: 7, 5, "x") == 7
    with pytest.raises(ZeroDivisionError):
        run_within(lambda: 1 / 0, 5, "x")


def test_this_process_s_side_failing_ends_the_wait_on_the_engines_at_once(monkeypatch):
    # The engines never answer (the limit is 60 s): rank 0's own side fails, and that ends the wait.
    _never_ready_ray(monkeypatch)

    def fail():
        raise RuntimeError("ncclCommInitRank failed: unhandled system error")

    with pytest.raises(RuntimeError, match="ncclCommInitRank failed"):
        get_within(["ref"], 60, "NCCL rendezvous", alongside=InThread(fail, "NCCL rendezvous (actor rank 0)"))


def test_the_engines_and_this_process_s_side_both_done_returns_both(monkeypatch):
    monkeypatch.setitem(
        sys.modules,
        "ray",
        types.SimpleNamespace(
            wait=lambda pending, num_returns, timeout: (pending[:1], pending[1:]),
            get=lambda refs, timeout=None: refs,
        ),
    )
    assert get_within(["a", "b"], 5, "x", alongside=InThread(lambda: "group", "x")) == ["a", "b", "group"]
    with pytest.raises(WeightSyncTimeout, match="x did not finish within 0.05 s"):
        get_within([], 0.05, "x", alongside=InThread(threading.Event().wait, "x"))


def test_a_timeout_names_the_workers_that_had_not_answered(monkeypatch):
    # "a" answers, "b" and "c" never do: the error names the two late ones (verify_engines names engines)
    def wait(pending, num_returns, timeout):
        if "a" in pending:
            return ["a"], [r for r in pending if r != "a"]
        threading.Event().wait(timeout)
        return [], pending

    monkeypatch.setitem(
        sys.modules, "ray", types.SimpleNamespace(wait=wait, get=lambda ref, timeout=None: ref)
    )
    with pytest.raises(WeightSyncTimeout) as e:
        get_within(
            ["a", "b", "c"], 0.05, "the engines' weight checksums", names=["engine 0", "engine 1", "engine 2"]
        )
    assert str(e.value) == (
        "weight sync: the engines' weight checksums (engine 1, engine 2 had not answered) did not finish within 0.05 s"
    )
