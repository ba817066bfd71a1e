"""Actor -> rollout engine weight transports: the flat buffer format, node-local files and their relay."""
