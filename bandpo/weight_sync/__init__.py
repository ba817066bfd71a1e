"""Actor -> rollout engine weight transports, one chosen per run by ``rollout.weight_sync``
(``transport``: auto = ipc colocated on GPU, nccl split on GPU, shm on CPU).

Modules: ``transport`` (the choice and the trainer's driver), ``ipc`` (CUDA IPC buckets from the
colocated actor ranks), ``nccl`` (NCCL broadcast from actor rank 0 over vLLM's weight-transfer
engine), ``node`` (publish and relay of the node-local /dev/shm files, which
``bandpo.shm.weight_files`` writes, space-checked, and reads), ``waits`` (the ipc and nccl transports' waits,
bounded by ``rollout.weight_sync_timeout``, each naming its stage when it runs out) and ``checksums``
(every engine's weights against the actor's, whatever the transport). The flat buffer layout
and the metadata's wire form every transport shares are ``bandpo.flat_buffer``'s.

Bytes through host memory per sync, W the weights' size: ipc and nccl none (GPU -> GPU); shm W
written by each node's writing rank, W more on each relayed node (the object store's copy, then
the file), and W read by each engine's load.

The rollout package imports these transports, never the other way round: nothing here imports
``bandpo.rollout`` or ``bandpo.actor``.
"""
