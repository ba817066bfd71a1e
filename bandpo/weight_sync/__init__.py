"""Actor -> rollout engine weight transports. Modules: ``format`` (the flat buffer layout and the
metadata's wire form, shared by every transport), ``shm`` (node-local /dev/shm files), ``node``
(publish and relay of those files across Ray nodes), ``ipc`` (CUDA IPC buckets), ``vllm_transfer``
(vLLM's weight-transfer engines).

Node-local /dev/shm files (``shm``, ``node``): the transport the trainer uses, on every device
(CPU and GPU). After each update the actor ranks write the full weights into one flat file per
node, nodes with engines but no actor rank get a copy through Ray's object store, and every
engine loads its own node's file (``NodeWeightSync``; ``RolloutWorker.update_weights_from_shm``).

CUDA IPC buckets (``ipc``): CUDA tensors packed into bounded-size GPU buffers and shared by IPC
handle. Only ``VllmEngine.update_weights`` with CUDA tensors (``_update_ipc``) and the vLLM worker
extension's ``bandpo_begin_update`` / ``bandpo_load_ipc`` / ``bandpo_finish_update`` use them, and
nothing in the trainer calls that path: it has no production caller yet.

vLLM's own weight-transfer engines (NCCL / IPC backends): ``VllmWeightSyncClient``
(``vllm_transfer``) drives ``RolloutWorker.weight_transfer`` / ``VllmEngine.weight_transfer`` on
every engine; no production caller drives it yet either.

The rollout package imports these transports, never the other way round: nothing here imports
``bandpo.rollout`` or ``bandpo.actor``.
"""
