"""The entropy test on the smollm2_arith recipe: does BandPO keep more of the policy's entropy than
GRPO? Stages 0-2 (``stage0``, ``stage1``, ``stage2`` and their .sh runners), the statistics
(``stats``), stage 2's design (``design``), verdict (``verdict``) and figure (``figure``); the
records in ``records/``, the report in ``results-entropy.md``."""
