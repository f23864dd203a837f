"""Rendezvous ports come from outside the range outgoing connections take theirs from."""

from __future__ import annotations

import socket

from scheduler.dist.ports import _bindable, _ephemeral_range, free_port


def test_ports_avoid_the_ephemeral_range_and_are_free() -> None:
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert not [p for p in ports if lo <= p <= hi]
    assert all(p >= 10000 for p in ports)
    assert len(set(ports)) > 150  # random, so two launches rarely pick the same port
    assert all(_bindable(p) for p in ports)


def test_a_held_port_is_not_free() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not _bindable(port)
    assert _bindable(port)


def test_without_room_outside_the_range_port_zero_decides() -> None:
    port = free_port(ephemeral=(1, 65535))
    assert 1 <= port <= 65535
    assert _bindable(port)
