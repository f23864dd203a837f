"""Destinations that reached a Mooncake prefill rank before the room's sender exists.

Decode sends a room's ``Destination`` as soon as it has the pages, and the router sends the
request to both sides at once, so a destination often arrives before this rank admitted the
request. :class:`EarlyDestinations` keeps them, per room and in arrival order, until
:class:`kv.mooncake_rooms.PrefillRooms` creates the room (:meth:`EarlyDestinations.take`) or
decode withdraws its own with an ``Abort`` (:meth:`EarlyDestinations.withdraw`) or leaves with a
``Deregister`` (:meth:`EarlyDestinations.withdraw_session`). It holds at
most ``limit`` rooms: one more evicts the oldest room's, which :meth:`EarlyDestinations.keep`
returns, so that its owner answers each (nothing will be written into them) and counts the
drop.

An ``Abort`` can also come before the destination it withdraws (decode sent the two on
different connections or threads): :class:`Withdrawals` remembers, per room and session, that
the destination still to come is withdrawn, so that it is answered rather than written into.
Both are not thread-safe: their owner's lock guards them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kv import wire
from kv.refusal import CAPACITY, TTL_S


class EarlyDestinations:
    """The early destinations of one prefill rank, by room (oldest room first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._rooms: OrderedDict[int, list[wire.Destination]] = OrderedDict()

    def keep(self, dest: wire.Destination) -> list[wire.Destination]:
        """Keep ``dest`` until its room is created; the destinations of the oldest room, in
        arrival order, when this makes one room too many (they are no longer kept), else
        none."""
        self._rooms.setdefault(dest.room, []).append(dest)
        if len(self._rooms) <= self.limit:
            return []
        _, evicted = self._rooms.popitem(last=False)
        return evicted

    def take(self, room: int) -> list[wire.Destination]:
        """The destinations kept for ``room``, in arrival order; none are kept after."""
        return self._rooms.pop(room, [])

    def holds(self, room: int, session: str) -> bool:
        """Whether a destination of ``session`` for ``room`` is kept."""
        return any(d.session == session for d in self._rooms.get(room, []))

    def withdraw(self, room: int, session: str) -> bool:
        """Drop ``session``'s destinations for ``room`` (an ``Abort`` from that session);
        whether there were any. The other sessions' stay."""
        kept = self._rooms.get(room, [])
        rest = [d for d in kept if d.session != session]
        if len(rest) == len(kept):
            return False
        if rest:
            self._rooms[room] = rest
        else:
            del self._rooms[room]
        return True

    def withdraw_session(self, session: str) -> list[wire.Destination]:
        """Drop every destination of ``session`` (it deregistered); those dropped, oldest room
        first."""
        dropped = [d for kept in self._rooms.values() for d in kept if d.session == session]
        for room in dict.fromkeys(d.room for d in dropped):
            self.withdraw(room, session)
        return dropped


class Withdrawals:
    """The (room, session) destinations withdrawn by an ``Abort`` before they came, oldest
    first. Bounded (the oldest goes first) and expiring, as :class:`kv.refusal.RefusedRooms`:
    a room number is drawn afresh per request, so an entry is about one request."""

    def __init__(self, *, clock: Callable[[], float], capacity: int = CAPACITY,
                 ttl_s: float = TTL_S) -> None:
        self._clock = clock
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._until: OrderedDict[tuple[int, str], float] = OrderedDict()

    def add(self, room: int, session: str) -> None:
        self._until.pop((room, session), None)
        self._until[(room, session)] = self._clock() + self._ttl_s
        while len(self._until) > self._capacity:
            self._until.popitem(last=False)

    def pop(self, room: int, session: str) -> bool:
        """Whether ``session``'s destination for ``room`` was withdrawn (no more after)."""
        self._expire()
        return self._until.pop((room, session), None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[key]
