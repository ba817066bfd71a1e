"""The claim test on the smollm2_arith recipe, with its rules fixed first in ``protocol.md``: a
random-reward test of each clip's own effect on entropy, and GRPO against BandPO on a pool it cannot
exhaust. The design as overrides (``design``), the runner that keeps each run's small records
(``run``), the records in ``records/``; Test 1's records read (``records``), its statistics (``stats``)
and its report and figure (``report``: ``results.md``, ``results-random.png``); Test 2's
pool candidates, measured on the base model before its pilot (``pool``)."""
