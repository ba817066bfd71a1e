"""The entry point's answer to the NaN/inf guard stopping the run: one line, exit 1, no engine.
The guard end to end on the real stack is in tests/integration/test_train_guards.py.
"""

from __future__ import annotations


def test_nonfinite_under_on_nonfinite_stop_ends_the_run_with_the_message(monkeypatch, capsys):
    # The guard's own stop is tested in test_reliability.py; here the entry point's answer to it
    # (one line, exit 1), without a second ~60 s engine start: the guard is what raises.
    from bandpo import train as entry
    from bandpo.run.nonfinite import NonfiniteGuard
    from bandpo.trainer import loop as trainer

    def train_until_the_guard_stops(cfg):
        NonfiniteGuard(cfg.trainer.on_nonfinite).check(1, "rewards")

    monkeypatch.setattr(trainer, "train", train_until_the_guard_stops)
    assert entry.main(["trainer.on_nonfinite=stop"]) == 1
    assert (
        "[bandpo] run stopped: FloatingPointError: step 1: non-finite values (NaN/inf) in rewards; stopping "
        "(trainer.on_nonfinite=stop)" in capsys.readouterr().err
    )
