"""What a run keeps and guards: checkpoints, the metrics log, worker logs, traces, /dev/shm hygiene, NaN guards."""
