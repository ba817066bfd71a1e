"""Checkpoints, in one place: the run's step folders and their ``latest`` pointer (``run_folders``; the
batch drawn ahead with them), each actor rank's DeepSpeed state and RNG states (``actor_state``), the
Hugging Face export and the consolidation of a checkpoint for evaluation (``hf_export``), a LoRA run's
adapter in PEFT's format and its merge for evaluation (``lora_adapter``), reading
checkpoint files without running code (``safe_load``), and the atomic, durable writes all of them use
(``atomic``).

Nothing is imported here: ``run_folders``, ``atomic``, ``safe_load`` and ``lora_adapter`` need no torch at import, the others do.
"""
