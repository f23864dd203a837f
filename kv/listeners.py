"""The TCP sockets a process listens on, read from ``/proc`` (Linux), and which of them listen
more widely than the addresses it was configured with.

pdlife binds its own sockets where it is told: the HTTP server and the bootstrap endpoint to
``--host``, the ZeroMQ control sockets to ``--mooncake-host``. The Mooncake transfer engine
does not: its handshake listener and its TCP data listener bind every interface (``0.0.0.0``,
and ``::`` dual-stack), whatever hostname it is given, and no setting of the engine changes that
(0.3.13; it does take its ports from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``, 15000..17000 by
default). :func:`wider_than` finds such listeners, so ``pdlife serve`` can say at start-up what
is exposed; docs/security.md says what to firewall.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Iterator

import attrs

logger = logging.getLogger(__name__)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_ESTABLISHED = "01"


@attrs.frozen
class Listener:
    """A listening TCP socket: its address (``0.0.0.0`` / ``::`` for every interface)."""

    host: str
    port: int

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.host).is_unspecified

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc prints the address as 32-bit words in host (little-endian) order.
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(socket.inet_ntop(family, packed))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _sockets(pid: int | None, state: str) -> Iterator[tuple[int, list[str]]]:
    """The address family and ``/proc/net/tcp`` row of each of process ``pid``'s (this one's
    by default) TCP sockets in ``state``."""
    pid = os.getpid() if pid is None else pid
    inodes = _socket_inodes(pid)
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == state and fields[9] in inodes:
                yield family, fields


def listening(pid: int | None = None) -> list[Listener]:
    """The TCP sockets process ``pid`` (this one by default) listens on, sorted."""
    found = set()
    for family, fields in _sockets(pid, _LISTEN):
        hex_addr, hex_port = fields[1].split(":")
        found.add(Listener(_address(hex_addr, family), int(hex_port, 16)))
    return sorted(found, key=lambda s: (s.port, s.host))


def connected_ports(pid: int | None = None, state: str = _ESTABLISHED) -> list[tuple[int, int]]:
    """(local port, remote port) of each of process ``pid``'s TCP connections in ``state``:
    ``/proc/net/tcp``'s hex code, ``01`` established (the default), ``08`` close-wait."""
    return [(int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16))
            for _, fields in _sockets(pid, state)]


def _resolved(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        return {str(info[4][0]) for info in found}


def wider_than(listeners: Iterable[Listener], hosts: Iterable[str]) -> list[Listener]:
    """The listeners that accept connections on more than ``hosts``: a wildcard listener, unless
    a wildcard was configured, and a listener on any other address."""
    allowed = set().union(*(_resolved(h) for h in hosts))
    if any(ipaddress.ip_address(a).is_unspecified for a in allowed):
        return []
    return [s for s in listeners if s.wildcard or s.host not in allowed]


class ExposureCheck:
    """Warns, once, when this process listens beyond ``hosts``: call it after every transfer
    engine the process starts (a decode server starts one per prefill server)."""

    def __init__(self, *hosts: str) -> None:
        self.hosts = hosts
        self.warned = False

    def __call__(self) -> list[Listener]:
        """The listeners wider than ``hosts``."""
        exposed = wider_than(listening(), self.hosts)
        if exposed and not self.warned:
            self.warned = True
            logger.warning(
                "this server is configured for %s, but it listens on every interface (%s): "
                "the Mooncake transfer engine's ports, MC_MIN_RPC_PORT..MC_MAX_RPC_PORT "
                "(15000-17000 by default), cannot be bound to an address; a firewall must "
                "keep them to the peers (docs/security.md)", " and ".join(sorted(set(self.hosts))),
                ", ".join(map(str, exposed)))
        return exposed
