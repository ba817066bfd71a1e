"""Fault test: SIGKILL a whole training run at random moments, resume it, and check that the
result equals an uninterrupted run's.

``python -m bandpo.tools.fault_test [--kills K] [--seed S] [--out DIR] OVERRIDES...`` (or
``scripts/fault_test.sh``) runs ``scripts/train.sh OVERRIDES`` twice over:

1. ``DIR/reference``: once, uninterrupted (its timings also pace the kills);
2. ``DIR/killed``: started in its own session (``setsid``) and SIGKILLed with everything it
   started (driver, Ray's GCS/raylet/workers, vLLM engine processes, verifier pool) K times,
   each time rerun with the same command until it completes. One kill lands while a
   checkpoint is being written (a ``checkpoints/.tmp-step_*`` folder of the live driver
   exists), the others at random points of a step or of start-up.

Then it checks (``checks.py``): every step logged exactly once, per-step metrics and final
weights equal to the reference's, every resume from the checkpoint ``latest`` named at the
kill, no temporary or half-written checkpoint left, no process of a killed run left alive
(``process.py``), no leaked /dev/shm weight buffer or LoRA adapter folder. It prints a summary, writes
``DIR/fault_test.json`` and exits 1 on any violation (2 on bad arguments).
"""
