"""Loopback ports to hand to a server or a rendezvous in another process: :func:`free_port`
(the tests' and benchmarks' workers, whose ports are picked before they start).

A port picked by binding port 0 comes from the kernel's ephemeral range, the range outgoing
connections also take their local ports from; between picking it and the bind of whoever is
handed it (a gloo rendezvous in another process, a server starting up), any connection on the
machine can take it (a transfer engine opens one per block). :func:`free_port` picks below that
range instead, where only a listener someone else chose could collide, and checks that nothing
holds the port now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Where Linux keeps the ephemeral range; its default when the file cannot be read.
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_EPHEMERAL_DEFAULT = (32768, 60999)
#: The lowest port handed out (above the registered services most machines run).
_LOWEST = 10000
_ATTEMPTS = 64


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT
    return lo, hi


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(ephemeral: tuple[int, int] | None = None) -> int:
    """A loopback port nothing holds now, outside the ephemeral range (``ephemeral``, default
    the kernel's) where there is room for it, else whatever port 0 gives."""
    lo, hi = ephemeral or _ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST, lo - 1), (hi + 1, 65535)) if b - a >= _ATTEMPTS]
    rng = random.Random()
    for _ in range(_ATTEMPTS if spans else 0):
        a, b = rng.choice(spans)
        port = rng.randint(a, b)
        if _bindable(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        chosen: int = sock.getsockname()[1]
        return chosen
