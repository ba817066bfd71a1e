"""Model helpers: the tiny Qwen2-architecture model built from scratch for CPU runs and tests
(``tiny``), and the tiny-arith recipe's warm-started build of it (``tiny_arith``, ``tiny_arith_sft``)."""
