"""``stop_on_sigterm``: SIGTERM unwinds the driver through its ``finally`` clean-up and exits 143; a second
SIGTERM kills at once. Each case is a fresh interpreter signalling itself (no Ray: the handler is Python's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import os, signal, time
from bandpo.distributed import stop_on_sigterm
stop_on_sigterm()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # never reached in full: the handler raises at the next bytecode
finally:
    print("clean-up ran", flush=True)
    if {again}:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("clean-up finished", flush=True)
"""


@pytest.mark.parametrize(
    "again,returncode,printed",
    [
        (False, 143, "clean-up ran\n"),  # 128 + SIGTERM (15), as a shell reports a run ended by it
        (True, -15, "clean-up ran\n"),  # the default action: killed by the signal, clean-up cut short
    ],
)
def test_sigterm_runs_the_clean_up_once(again, returncode, printed):
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(again=again)], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (returncode, printed), proc.stderr
    assert "[bandpo] SIGTERM: stopping the run's workers" in proc.stderr
