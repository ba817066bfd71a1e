"""A free TCP port for a rendezvous that another process binds later (torch.distributed, NCCL).

The port is chosen here and bound later by someone else (rank 0's TCPStore, the NCCL group's
master), so between the two it is free for anyone. ``bind(("", 0))`` answers from the kernel's
ephemeral range, the same range every outgoing connection on the node draws its local port from;
with Ray's many gRPC connections one of them can take the port first, and rank 0 then fails with
EADDRINUSE. Ports below that range are only ever taken by an explicit bind, so one chosen there
and free now stays free in practice.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 20000  # above the well-known and most registered service ports
TRIES = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for ports it picks itself; Linux's default where the file is absent."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def free_port(rng: random.Random | None = None) -> int:
    """A port that binds now, outside the ephemeral range when there is room below it.

    Falls back to the kernel's choice (``bind(("", 0))``) when nothing below the range is free
    after ``TRIES`` draws, or the range starts at or below ``LOWEST``.
    """
    rng = rng or random.Random()
    low = ephemeral_range()[0]
    if low > LOWEST:
        for _ in range(TRIES):
            port = rng.randrange(LOWEST, low)
            if is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
