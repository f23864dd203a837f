"""The decode ranks that watch a room of a Mooncake prefill rank before their destination comes.

A decode rank holds a request from its admission, but sends the room's ``Destination`` only
once it has pages for it, which under load can be long after the prefill side refused the room
or failed it (draining, a prompt too long, its client gone, its bootstrap timeout). Its
``Watch`` (:class:`kv.wire.Watch`) asks to hear of such a failure at once. :class:`Watchers`
keeps, per room and until the session's destination comes, the sessions that asked; the room
table (:class:`kv.mooncake_rooms.PrefillRooms`) takes them when the room fails and owes each a
FAILED ``Status``. It also remembers, for a while, which sessions were told, so a destination
that crossed the ``Status`` on the wire is not answered with the same failure a second time.

Both records are bounded (the oldest room goes first): losing a watch only delays the news
until the destination comes, as without one. Not thread-safe: its owner's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict


class Watchers:
    """The watching decode sessions of one prefill rank, by room (oldest room first)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = limit
        self._rooms: OrderedDict[int, set[str]] = OrderedDict()
        self._told: OrderedDict[tuple[int, str], None] = OrderedDict()

    def rooms(self) -> list[int]:
        """The rooms watched, oldest first."""
        return list(self._rooms)

    def add(self, room: int, session: str) -> None:
        self._rooms.setdefault(room, set()).add(session)
        while len(self._rooms) > self._limit:
            self._rooms.popitem(last=False)

    def drop(self, room: int, session: str) -> None:
        """``session`` sent ``room``'s destination: from now on the room's legs carry the news."""
        sessions = self._rooms.get(room)
        if sessions is not None:
            sessions.discard(session)
            if not sessions:
                del self._rooms[room]

    def forget(self, room: int) -> None:
        """Nobody is to be told of ``room`` (the decode side ended it itself)."""
        self._rooms.pop(room, None)

    def forget_session(self, session: str) -> None:
        """``session`` is gone: it reads no more statuses."""
        for room in [r for r, sessions in self._rooms.items() if session in sessions]:
            self.drop(room, session)

    def take(self, room: int, skip: frozenset[str] = frozenset()) -> list[str]:
        """The sessions watching ``room`` that are to be told of its failure now, except
        ``skip`` (sessions told another way); they are remembered as told."""
        sessions = sorted(self._rooms.pop(room, set()) - skip)
        for session in sessions:
            self._told[(room, session)] = None
            while len(self._told) > self._limit:
                self._told.popitem(last=False)
        return sessions

    def was_told(self, room: int, session: str) -> bool:
        """Whether ``session`` was told of ``room``'s failure through its watch (once: a later
        use of the room number is news again)."""
        if (room, session) not in self._told:
            return False
        del self._told[(room, session)]
        return True
