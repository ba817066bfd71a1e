"""Tools around training runs (the fault-injection harness)."""
