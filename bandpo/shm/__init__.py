"""Everything bandpo puts in, or clears out of, /dev/shm (tmpfs: RAM), in one place.

``weight_files``: the node-local weight file of the ``shm`` weight sync (``rollout.weight_sync=shm``;
``bandpo.weight_sync.node`` publishes and relays it), its space check, and the removal of the files of
drivers that no longer run. ``vllm_leftovers``: the vLLM message queues and semaphores a killed run
leaves behind, recorded while a run lives and removed at the next start (``clean_shm``).

Nothing is imported here: ``weight_files`` needs torch, ``vllm_leftovers`` psutil only when recording.
"""
