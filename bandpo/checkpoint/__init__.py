"""Checkpoints, in one place: the run's step folders and their ``latest`` pointer (``run_folders``; the
batch drawn ahead with them), each actor rank's DeepSpeed state and RNG states (``actor_state``), the
Hugging Face export and the consolidation of a checkpoint for evaluation (``hf_export``), reading
checkpoint files without running code (``safe_load``), and the atomic, durable writes all of them use
(``atomic``).

Nothing is imported here: ``run_folders``, ``atomic`` and ``safe_load`` need no torch at import, the others do.
"""
