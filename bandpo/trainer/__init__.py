"""The training loop (``loop``), what it starts (``launch``), its stages 1-3 (``dynamic_sampling``) and metrics."""
