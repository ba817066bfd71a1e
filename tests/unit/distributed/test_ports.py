"""The rendezvous port is drawn below the kernel's ephemeral range, where outgoing connections never land."""

import random
import socket

from bandpo.distributed import ports


def test_port_is_below_the_ephemeral_range_and_binds():
    low, _ = ports.ephemeral_range()
    port = ports.free_port(random.Random(0))
    if low > ports.LOWEST:
        assert ports.LOWEST <= port < low
    assert ports.is_free(port)


def test_a_taken_port_is_not_chosen(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 2, 60999))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", ports.LOWEST))
        s.listen()
        if not ports.is_free(ports.LOWEST + 1):
            return  # someone else holds the other candidate: nothing to choose between
        # two candidates, one taken: 64 draws all miss the free one with probability 2**-64
        assert ports.free_port(random.Random(1)) == ports.LOWEST + 1


def test_no_room_below_the_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 60999))
    port = ports.free_port()
    assert 0 < port < 65536


def test_range_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "absent")) == (32768, 60999)
