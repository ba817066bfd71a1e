"""What a run keeps and guards: the metrics log, worker logs, traces, /dev/shm hygiene, NaN guards (its checkpoints: ``bandpo.checkpoint``)."""
