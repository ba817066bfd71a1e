"""The training loop (``loop``) and what it starts and stops (``startup``)."""
