"""DeepSpeed actor: log-probs, policy updates, weights for sync, checkpoints (see ``worker.Actor``).

Imports torch only; DeepSpeed and Ray are imported when an actor or group is built.
"""

from bandpo.actor.group import ActorGroup, shard_batch, unshard_rows
from bandpo.actor.worker import Actor

__all__ = ["Actor", "ActorGroup", "shard_batch", "unshard_rows"]
