"""The GPU smoke test and actor benchmark: ``python -m bandpo.tools.gpu_smoke [--cpu]`` (``cli``'s docstring
says what it checks; ``checks`` and ``lora`` hold the checks). Imports only torch, transformers,
DeepSpeed, PEFT and (for the plan's estimate) Hydra: a lent GPU machine has no Ray or vLLM."""
