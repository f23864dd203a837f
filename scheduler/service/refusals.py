"""Refusals the HTTP service makes, told to the request's peer.

A PD router sends each ``/generate`` to a prefill and a decode worker with the same bootstrap
fields. A worker that refuses the request before an engine sees it (draining, bad input, a
duplicate id) tells the other worker through its engine (:meth:`PrefillScheduler.refuse_room`,
:meth:`DecodePeer.refuse_room`; :mod:`kv.refusal`), so the other half fails at once with
``peer refused: <kind> (<status>): <message>`` instead of waiting for its bootstrap or waiting
timeout (a prefill worker with DP replicas has the replica of the room refuse it, as decode asks
that replica for the room's KV); a kind the client can act on (a 4xx, or 503) is what that half
answers too (:func:`kv.refusal.refused_for_the_client`), so a router passes the same status on
whichever worker it reads.
Only the Mooncake backend pairs workers; the local and fake backends choose their own rooms.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kv.refusal import peer_refusal
from scheduler.messages import FAKE_BOOTSTRAP_HOST
from scheduler.service.core import Item, Service

_MAX_ROOM = (1 << 64) - 1
_MAX_REASON = 400


def _each(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] * n


def peer_rooms(body: Any) -> Iterator[tuple[str, int, int]]:
    """The ``(bootstrap_host, bootstrap_port, bootstrap_room)`` of every prompt of a
    ``/generate`` body (a mapping, checked or not) that names a real peer; malformed entries
    are left out."""
    if not isinstance(body, Mapping):
        return
    fields = [body.get(name) for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room")]
    n = max((len(f) for f in fields if isinstance(f, list)), default=1)
    for host, port, room in zip(*(_each(f, n) for f in fields), strict=False):
        if not isinstance(host, str) or not host or host == FAKE_BOOTSTRAP_HOST:
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (port, room)):
            continue
        if 1 <= port <= 65535 and 0 <= room <= _MAX_ROOM:
            yield host, port, room


def refuse_peers(service: Service, rooms: Iterator[tuple[str, int, int]], kind: str,
                 status: int, message: str) -> None:
    """Tell the peers of ``rooms`` that this worker refused their request (``kind`` and
    ``status`` are the error type and HTTP status the client got). A room a live request holds
    is left alone: its refusal would fail that request's other half (a retried request, a
    duplicate rid); so is a peer this worker may not contact (``--allow-prefill``: the refusal
    would carry its peer token there)."""
    if service.config.backend != "mooncake":
        return
    engine = service.prefill if service.prefill is not None else service.decode
    if engine is None:
        return
    why = peer_refusal(kind, status, message)[:_MAX_REASON]
    held = service.live_rooms()
    for host, port, room in rooms:
        if ((host, port, room) not in held and service.config.may_contact(host, port)
                and not service.refuse_on_replica(room, why)):
            engine.refuse_room(host, port, room, why)


def refuse_items(service: Service, items: list[Item], kind: str, status: int,
                 message: str) -> None:
    """:func:`refuse_peers` for checked items."""
    refuse_peers(service, ((i.bootstrap_host, i.bootstrap_port, i.bootstrap_room)
                           for i in items if not i.fake), kind, status, message)
