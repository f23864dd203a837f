"""The rooms of one Mooncake prefill rank: every change to a room's state, under one lock.

Theory of operation
-------------------
:class:`PrefillRooms` is the one owner of the prefill side's room state; the control listener,
the senders and the transfer workers of :mod:`kv.mooncake` and :mod:`kv.mooncake_writes` change
a room only through its methods. It does no I/O: a change that owes decode a ``Status`` returns
an :class:`Owed` for the caller to push once the lock is released, and a chunk to write is
returned for the caller to queue.

A room moves BOOTSTRAPPING → WAITING_FOR_INPUT (its ``Destination`` arrived) → TRANSFERRING
(first chunk queued) → SUCCESS / FAILED; SUCCESS and FAILED latch. Readiness goes to
:attr:`PrefillRooms.ready` whenever a poll result may have changed, and when a failed room
becomes quiescent.

Decode sessions: a ``Register`` makes a session known (and lifts its blacklist); a destination
from an unknown session is refused. A session is blacklisted after a failed engine write: its
live rooms fail at once, since none of them can succeed.

A destination that arrives before its sender exists waits (at most ``max_early_destinations``,
oldest evicted first). ``clear()`` forgets a room and leaves a tombstone, so a late
``Destination`` or ``Abort`` for it is dropped rather than attached to a later request that
reuses the room number.

Decode reads a FAILED ``Status`` as "prefill no longer writes into these pages", so it is owed
only once the failed room is quiescent: no chunk of it queued or being written.

Refusals (:mod:`kv.refusal`): a room this rank refused (:meth:`PrefillRooms.refuse`), or that
failed before its destination came, is recorded, and a destination for it is answered with a
FAILED ``Status`` naming the refusal instead of being kept or dropped; a live room's own first
destination is still its own. A room the decode peer refused (:meth:`PrefillRooms.peer_refused`)
fails at once while it waits for its destination, or as soon as it is created.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kv import wire
from kv.refusal import RefusedRooms
from kv.transfer import (
    REASON_PEER_ABORTED,
    REASON_PEER_REFUSED,
    KVPoll,
    SendCursor,
    TransferError,
    TransferUsageError,
    accepts_call,
    refusal,
)

_TOMBSTONES = 65536


@attrs.frozen
class Owed:
    """A ``Status`` owed to decode session ``session`` for ``room``."""

    session: str
    room: int
    poll: KVPoll
    reason: str = ""


@attrs.define(eq=False)
class PrefillRoom:
    room: int
    created: float
    status: KVPoll = KVPoll.BOOTSTRAPPING
    reason: str = ""
    timed_out: bool = False
    dest: wire.Destination | None = None
    reg: wire.Register | None = None
    cursor: SendCursor = attrs.field(init=False)
    in_flight: int = 0
    # Decode was told of the failure, after the room went quiescent (see PrefillRooms._settle).
    notified: bool = False

    def __attrs_post_init__(self) -> None:
        self.cursor = SendCursor(self.room)


@attrs.frozen(eq=False)
class Chunk:
    """Pages of one room to write: source pages here, destination pages on decode."""

    rec: PrefillRoom
    src: Sequence[int]
    dst: np.ndarray
    last: bool

    @property
    def session(self) -> str:
        assert self.rec.dest is not None
        return self.rec.dest.session


class PrefillRooms:
    """The room table of one prefill rank (thread-safe)."""

    def __init__(
        self,
        *,
        num_slots: int,
        bootstrap_timeout_s: float,
        max_early_destinations: int,
        clock: Callable[[], float],
    ) -> None:
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._num_slots = num_slots
        self._bootstrap_timeout_s = bootstrap_timeout_s
        self._max_early = max_early_destinations
        self._clock = clock
        self._lock = threading.Lock()
        self._rooms: dict[int, PrefillRoom] = {}
        self._early: OrderedDict[int, wire.Destination] = OrderedDict()
        self._tombstones: OrderedDict[int, None] = OrderedDict()
        self._sessions: dict[str, wire.Register] = {}
        self._blacklist: set[str] = set()
        self._refused = RefusedRooms(clock=clock)  # rooms this rank will not serve
        self._peer_refused = RefusedRooms(clock=clock)  # rooms decode will not ask for

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    # -- control messages (listener thread) --------------------------------------------------

    def register(self, reg: wire.Register) -> None:
        with self._lock:
            self._sessions[reg.session] = reg
            self._blacklist.discard(reg.session)

    def destination(self, dest: wire.Destination) -> Owed | None:
        """Attach ``dest`` to its room, or keep it until the room's sender exists; for a room
        that failed before its handshake or was refused, the refusal owed to decode instead.
        Raises :class:`~kv.wire.WireError` for a destination that must be dropped."""
        with self._lock:
            wire.check_destination(dest, self._sessions)
            rec = self._rooms.get(dest.room)
            if rec is not None and rec.dest is None:
                if rec.status == KVPoll.FAILED:
                    return self._refusal(dest, rec.reason)
                self._accept(rec, dest)
                return None
            refused = self._refused.get(dest.room)
            if refused is not None:
                return self._refusal(dest, refused)
            if rec is not None:
                raise wire.WireError("duplicate_destination", f"room {dest.room}")
            if dest.room in self._tombstones:
                raise wire.WireError("stale_room", f"room {dest.room} was already cleared")
            self._early[dest.room] = dest
            if len(self._early) > self._max_early:
                evicted, _ = self._early.popitem(last=False)
                raise wire.WireError("early_overflow", f"evicted early room {evicted}")
            return None

    def refuse(self, room: int, reason: str) -> Owed | None:
        """This rank will not serve ``room``: a destination for it, already waiting or still
        to come, is answered with the refusal (the status owed now, if one waited)."""
        with self._lock:
            self._refused.add(room, reason)
            early = self._early.pop(room, None)
            return None if early is None else self._refusal(early, reason)

    def peer_refused(self, room: int, reason: str) -> None:
        """Decode will never send ``room``'s destination: the room fails now if it waits for
        one, or when it is created (a room that has its destination is paired; decode aborts
        those with an ``Abort``)."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                self._peer_refused.add(room, reason)
            elif rec.dest is None:
                self._fail(rec, refusal(reason))

    def peer_abort(self, msg: wire.Abort) -> Owed | None:
        """Decode aborted a room; raises :class:`~kv.wire.WireError` if the abort is stale or
        comes from another session."""
        with self._lock:
            rec = self._rooms.get(msg.room)
            # Decode aborts only rooms it sent a destination for, on the same ordered socket:
            # an abort for a room without one belongs to an earlier use of the room number.
            if rec is None or rec.dest is None:
                raise wire.WireError("stale_room", f"abort for unknown room {msg.room}")
            if rec.dest.session != msg.session:
                raise wire.WireError(
                    "foreign_abort", f"room {msg.room} belongs to {rec.dest.session}"
                )
            self._fail(rec, REASON_PEER_ABORTED)
            return self._settle(rec)

    # -- senders (scheduler thread) ------------------------------------------------------------

    def create(self, room: int) -> PrefillRoom:
        with self._lock:
            if room in self._rooms:
                raise TransferUsageError(room, "a live sender exists for this room; clear() it")
            rec = PrefillRoom(room=room, created=self._clock())
            self._rooms[room] = rec
            self._tombstones.pop(room, None)
            early = self._early.pop(room, None)
            refused = self._peer_refused.pop(room)
            if refused is not None:
                self._fail(rec, refusal(refused))
            elif early is not None:
                self._accept(rec, early)
        return rec

    def init(self, rec: PrefillRoom, num_pages: int, slot: int) -> Owed | None:
        if not 0 <= slot < self._num_slots:
            raise TransferUsageError(rec.room, f"slot {slot} not in 0..{self._num_slots - 1}")
        with self._lock:
            dest = rec.dest
            if not accepts_call(rec.room, rec.status, "init()", ready=dest is not None):
                return None
            assert dest is not None
            rec.cursor.init(num_pages, slot)
            if num_pages <= len(dest.pages):
                return None
            self._fail(rec, f"decode session {dest.session} offered {len(dest.pages)} pages, "
                            f"the request needs {num_pages}")
            return self._settle(rec)

    def chunk(self, rec: PrefillRoom, pages: Sequence[int], last: bool) -> Chunk | None:
        """The chunk to write for ``send(pages, last)``, or None when there is nothing to
        write (a failed room, an empty chunk that is not the last)."""
        with self._lock:
            if rec.status == KVPoll.FAILED:
                return None
            if rec.cursor.num_pages is None or rec.dest is None:
                raise TransferUsageError(rec.room, f"send() before init() while {rec.status.name}")
            span = rec.cursor.advance(len(pages), last)
            if not self._live(rec) or (not pages and not last):
                return None
            rec.in_flight += 1
            rec.status = KVPoll.TRANSFERRING
            return Chunk(rec, list(pages), rec.dest.pages[span], last)

    def poll(self, rec: PrefillRoom) -> KVPoll:
        """The room's status; a room still BOOTSTRAPPING past the bootstrap timeout fails."""
        with self._lock:
            if rec.status == KVPoll.BOOTSTRAPPING:
                waited = self._clock() - rec.created
                if waited >= self._bootstrap_timeout_s:
                    self._fail(rec, f"no destination from decode after {waited:.1f}s "
                                    "(bootstrap timeout)", timed_out=True)
            return rec.status

    def failure(self, rec: PrefillRoom) -> TransferError:
        with self._lock:
            peer = rec.dest.session if rec.dest is not None else ""
            return TransferError.reported(rec.room, rec.status, rec.reason, peer,
                                          timeout=rec.timed_out)

    def fail(self, rec: PrefillRoom, reason: str) -> Owed | None:
        """Fail the room (its sender aborted it); the status owed to decode, if any."""
        with self._lock:
            self._fail(rec, reason)
            return self._settle(rec)

    def clear(self, rec: PrefillRoom) -> None:
        with self._lock:
            if self._rooms.get(rec.room) is rec:
                del self._rooms[rec.room]
                self._early.pop(rec.room, None)
                self._tombstones[rec.room] = None
                # Failed before decode's destination came: a late one gets the refusal.
                if (rec.dest is None and rec.status == KVPoll.FAILED
                        and not rec.reason.startswith(REASON_PEER_REFUSED)):
                    self._refused.add(rec.room, rec.reason)
                if len(self._tombstones) > _TOMBSTONES:
                    self._tombstones.popitem(last=False)

    def quiescent(self, rec: PrefillRoom) -> bool:
        with self._lock:
            return rec.in_flight == 0

    # -- transfer workers -----------------------------------------------------------------------

    def live(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """The chunks whose room is live: neither concluded nor cleared."""
        with self._lock:
            return [c for c in chunks if self._live(c.rec)]

    def blacklisted(self, session: str) -> bool:
        with self._lock:
            return session in self._blacklist

    def conclude(
        self, chunks: Sequence[Chunk], session: str, error: str | None, engine_failed: bool
    ) -> list[Owed]:
        """Chunks written to ``session`` are done: with ``error`` their rooms fail, else last
        chunks succeed; a failed engine write blacklists the session. The statuses owed."""
        owed: list[Owed | None] = []
        with self._lock:
            for chunk in chunks:
                rec = chunk.rec
                rec.in_flight -= 1
                if error is not None:
                    self._fail(rec, error)
                elif chunk.last and self._live(rec):
                    rec.status = KVPoll.SUCCESS
                    self.ready.put(rec.room)
                    owed.append(Owed(session, rec.room, KVPoll.SUCCESS))
            if engine_failed and session not in self._blacklist:
                self._blacklist.add(session)
                owed += self._fail_session(session)
            owed += [self._settle(chunk.rec) for chunk in chunks]
        return [o for o in owed if o is not None]

    # -- callers hold self._lock -----------------------------------------------------------------

    def _refusal(self, dest: wire.Destination, reason: str) -> Owed:
        return Owed(dest.session, dest.room, KVPoll.FAILED, refusal(reason))

    def _accept(self, rec: PrefillRoom, dest: wire.Destination) -> None:
        rec.dest = dest
        rec.reg = self._sessions[dest.session]
        if rec.status == KVPoll.BOOTSTRAPPING:
            rec.status = KVPoll.WAITING_FOR_INPUT
            self.ready.put(rec.room)

    def _fail(self, rec: PrefillRoom, reason: str, *, timed_out: bool = False) -> bool:
        if rec.status.terminal:
            return False
        rec.status = KVPoll.FAILED
        rec.reason = reason
        rec.timed_out = timed_out
        self.ready.put(rec.room)
        return True

    def _settle(self, rec: PrefillRoom) -> Owed | None:
        """The FAILED status owed to decode once a failed room is quiescent, if any."""
        if rec.status != KVPoll.FAILED or rec.in_flight or rec.notified:
            return None
        rec.notified = True
        if rec.dest is None:
            return None
        self.ready.put(rec.room)  # quiescence is news to the owner of the pages
        return Owed(rec.dest.session, rec.room, KVPoll.FAILED, rec.reason)

    def _fail_session(self, session: str) -> list[Owed | None]:
        """Fail every live room of a blacklisted session: none of them can succeed."""
        reason = f"decode session {session} was blacklisted after a failed transfer"
        failed = [r for r in self._rooms.values()
                  if r.dest is not None and r.dest.session == session and self._fail(r, reason)]
        return [self._settle(r) for r in failed]

    def _live(self, rec: PrefillRoom) -> bool:
        return self._rooms.get(rec.room) is rec and not rec.status.terminal
