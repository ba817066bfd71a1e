"""Model helpers: the tiny Qwen2-architecture model built from scratch for CPU runs and tests."""
