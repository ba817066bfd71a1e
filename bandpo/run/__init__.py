"""What a run keeps and guards: the metrics log, worker logs, traces, NaN guards (its checkpoints: ``bandpo.checkpoint``; /dev/shm: ``bandpo.shm``)."""
