"""Band against its rivals (GRPO, Clip-Higher, BandPO, DPPO-TV, DCPO) on the smollm2_arith recipe:
``rivals.sh`` runs them through studies/compare/compare.sh; the finished runs' numbers are kept in
``records/``, the reports in results-rivals.md and results-rivals-quick.md. No Python of its own."""
