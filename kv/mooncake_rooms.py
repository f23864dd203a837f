"""The rooms of one Mooncake prefill rank: every change to a room's state, under one lock.

Theory of operation
-------------------
:class:`PrefillRooms` is the one owner of the prefill side's room state; the control listener,
the senders and the transfer workers of :mod:`kv.mooncake` and :mod:`kv.mooncake_writes` change
a room only through its methods. It does no I/O: a change that owes decode a ``Status`` returns
the :class:`~kv.mooncake_legs.Owed` statuses for the caller to push once the lock is released,
and the chunks to write are returned for the caller to queue.

A room serves one or more decode ranks (:mod:`kv.routes`: with decode at a larger TP size than
prefill, or GQA replicas, one prefill rank writes into several): each one's ``Destination`` is a
:class:`~kv.mooncake_legs.Leg`. A room moves BOOTSTRAPPING → WAITING_FOR_INPUT (the destination
of every decode rank it waits for arrived) → TRANSFERRING (first chunk queued: one chunk per leg
this rank writes into) → SUCCESS (the last chunk reached every leg; each of them is told) /
FAILED (each leg is told); SUCCESS and FAILED latch. A status-only rank (it writes nothing,
:meth:`kv.layouts.SlicePlan.status_only`) still waits for its destinations, succeeds with its
last chunk without writing and tells no one. Readiness goes to :attr:`PrefillRooms.ready`
whenever a poll result may have changed, and when a failed room becomes quiescent.

Decode sessions: a ``Register`` makes a session known (and lifts its blacklist) with what this
rank writes into it (:class:`~kv.mooncake_slices.Target`); a destination from an unknown session
is refused, and so is one from a decode rank the room does not wait for (``not_a_contact``).
A session is blacklisted after a failed engine write: its live rooms fail at once, since none
of them can succeed. A ``Deregister`` (the decode manager closed) forgets the session: its live
rooms fail the same way, its early destinations are answered, and a room it had sent one for
fails when created. A decode rank that cannot say goodbye (killed, its host gone) is forgotten
the same way once it is silent: its ``Register`` comes again every ``keepalive_ms`` (the same
one: :meth:`touch` notes the time and lifts the blacklist), and a session not heard from for
:func:`silence_limit` is :meth:`silent` (the manager forgets it). A changed ``Register`` of a
known session (a decode process restarted on the same engine port) is forgotten first too.

A destination that arrives before its sender exists waits (:mod:`kv.mooncake_early`), also
for a room number used before and cleared: decode sends one destination per use of a room, so
a destination no live room holds is a new use's.

Every destination is answered with exactly one ``Status``: its room's SUCCESS or FAILED, a
refusal, or, for one this rank drops (it does not fit the session's registration, the rank
does not serve its decode rank, a second one, one evicted from the early store), a FAILED one
naming the drop (:class:`AnsweredDrop`), unless the session's destination already held here
for the room is still to be answered. Decode reads a FAILED ``Status`` as "prefill no longer
writes into these pages", so a room's is owed only once the failed room is quiescent: no chunk
of it queued or being written. Each answer is remembered, per room and session, until that session
sends the room another destination: an ``Abort`` that came after it was sent is answered with it
again, marked ``again`` (:class:`Repeated`: the first may have been lost on the way, a connection
torn down with messages queued, and decode holds the room's pages until one comes; with the mark
decode applies it only to a use of the room number that sent this rank an ``Abort`` after its
destination, so a later use whose ``Abort`` overtook its destination never takes it), and
dropped (``stale_room``) only where none was sent yet (the failed room is not
quiescent: its own is still to come) or none is owed (a status-only rank's success); any other
``Abort`` this rank cannot match to a live destination (one it dropped, never had or no longer
remembers answering, or of a room that concluded while its ``Status`` could not be sent,
:meth:`not_told`) is answered with a FAILED ``Status``. Such an ``Abort`` may have overtaken its
destination (decode sent the two on different connections or threads), so it is recorded
(:class:`~kv.mooncake_early.Withdrawals`): the session's destination that comes after it is
answered and never attached, a live room still waiting for it fails as an abort of a paired room
does, and a room not created yet fails when it is.

A decode rank whose state pools this rank cannot serve (:func:`kv.mooncake_state.state_target`)
is registered with the reason: each destination from it fails its room on both sides at once
(or, for a room whose sender does not exist yet, when it is created). A last chunk whose state
items (:meth:`PrefillRooms.set_state`) do not pair with a destination's fails the room.

Refusals (:mod:`kv.refusal`): a room this rank refused (:meth:`PrefillRooms.refuse`), or that
failed before its destination came, is recorded, and a destination for it is answered with a
FAILED ``Status`` naming the refusal instead of being kept or dropped; a live room's own first
destination is still its own. A room the decode peer refused (:meth:`PrefillRooms.peer_refused`)
fails at once while it waits for its destination, or as soon as it is created.

Watches (:mod:`kv.mooncake_watch`): a decode rank that holds a room but has no pages for it yet
sends a ``Watch``. A refusal of the room, or its failure before that rank's destination came, is
owed to it at once (a refusal that came before the watch, when the watch comes) rather than when
its destination comes, which may be long after; a destination that crossed that ``Status`` on the
wire is not answered a second time. A failure the decode side caused itself (its refusal, its
abort) is owed to no watcher.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs

from kv import wire
from kv.mooncake_early import EarlyDestinations, Withdrawals
from kv.mooncake_legs import Chunk, Leg, Owed, PrefillRoom
from kv.mooncake_slices import Target
from kv.mooncake_watch import Watchers
from kv.refusal import RefusedRooms
from kv.state_copy import pairing
from kv.state_pools import StateKind
from kv.transfer import (
    REASON_ABORTED,
    REASON_PEER_ABORTED,
    REASON_PEER_REFUSED,
    KVPoll,
    TransferError,
    TransferUsageError,
    accepts_call,
    refusal,
)

logger = logging.getLogger(__name__)

#: The (room, session) answers remembered (the oldest go first): an ``Abort`` that crossed one
#: is not answered a second time.
_ANSWERED = 65536
#: The most rooms watched at once (the oldest watch is dropped beyond: its room's failure then
#: reaches decode when its destination comes, as without a watch).
_WATCHED_ROOMS = 16384
#: A session is forgotten after this many keepalives in a row did not come, and never sooner
#: than :data:`MIN_SILENCE_S`: a decode process paused (a long native call holding Python's
#: lock, a stop-the-world pause) must not lose its rooms.
KEEPALIVE_MISSES = 6
MIN_SILENCE_S = 30.0


def _ended_by_decode(reason: str) -> bool:
    """Whether a room that failed for ``reason`` was failed by the decode side (it refused or
    aborted it)."""
    return reason == REASON_PEER_ABORTED or reason.startswith(REASON_PEER_REFUSED)


def _as_refusal(reason: str) -> str:
    """``reason`` as the refusal decode is told: a room that failed with a refusal already
    (one decode refused) is told that one, not a refusal of it."""
    return reason if reason.startswith(f"{REASON_PEER_REFUSED}:") else refusal(reason)


def silence_limit(reg: wire.Register) -> float | None:
    """How long (s) the session of ``reg`` may be silent before it counts as gone; None for a
    decode rank that sends no keepalive."""
    if reg.keepalive_ms == 0:
        return None
    return max(KEEPALIVE_MISSES * reg.keepalive_ms / 1000, MIN_SILENCE_S)


@attrs.frozen
class Repeated(Owed):
    """A ``Status`` owed to decode a second time: it answers an ``Abort`` that came after the
    first was sent, and goes marked ``again`` (:class:`kv.wire.Status`), so decode applies it
    only to the use of the room that sent the ``Abort``."""


class AnsweredDrop(wire.WireError):
    """A dropped destination (its reason and detail, as any :class:`~kv.wire.WireError`) and
    the FAILED ``Status`` its decode rank is owed for it (``owed``: none where the session's
    destination held here answers for it), for the caller to push before it counts the drop."""

    def __init__(self, err: wire.WireError, owed: list[Owed]) -> None:
        super().__init__(err.reason, err.detail)
        self.owed = owed


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
        self._clock = clock
        self._lock = threading.Lock()
        self._rooms: dict[int, PrefillRoom] = {}
        self._early = EarlyDestinations(max_early_destinations)
        # The (room, session) pairs answered with a Status since that session's last
        # destination for the room came, each with that Status (None: none sent yet, or none
        # owed: a status-only rank's success).
        self._answered: OrderedDict[tuple[int, str], tuple[KVPoll, str] | None] = OrderedDict()
        self._closed = ""  # why no room is served any more (close)
        self._regs: dict[str, wire.Register] = {}
        self._targets: dict[str, Target] = {}
        self._heard: dict[str, float] = {}  # when each session's Register last came (clock)
        self._blacklist: set[str] = set()
        self._refused = RefusedRooms(clock=clock)  # rooms this rank will not serve
        self._peer_refused = RefusedRooms(clock=clock)  # rooms decode will not ask for
        # Rooms whose early destinations this rank dropped: their senders fail when created.
        self._overflowed = RefusedRooms(clock=clock)
        self._withdrawn = Withdrawals(clock=clock)  # destinations aborted before they came
        self._watchers = Watchers(_WATCHED_ROOMS)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    def sessions(self) -> list[str]:
        """The decode sessions registered with this rank, sorted."""
        with self._lock:
            return sorted(self._targets)

    # -- control messages (listener thread) --------------------------------------------------

    def register(self, target: Target) -> None:
        session = target.reg.session
        with self._lock:
            self._regs[session] = target.reg
            self._targets[session] = target
            self._heard[session] = self._clock()
            self._blacklist.discard(session)

    def touch(self, reg: wire.Register) -> bool:
        """``reg`` is the registration its session holds already (a keepalive): note the time
        and lift its blacklist, as any ``Register`` does (a decode rank that still sends it
        is alive, so a failed write may have been passing; a dead one sends none and stays
        blacklisted until it is forgotten); nothing else changes. False for a new or changed
        one, which the caller registers in full."""
        session = reg.session
        with self._lock:
            if self._regs.get(session) != reg:
                return False
            self._heard[session] = self._clock()
            lifted = session in self._blacklist
            self._blacklist.discard(session)
        if lifted:
            logger.info("decode session %s: its keepalive lifted its blacklist", session)
        return True

    def heard(self, session: str) -> float | None:
        """When (this table's clock) ``session``'s ``Register`` last came; None if unknown."""
        with self._lock:
            return self._heard.get(session)

    def known(self, session: str) -> bool:
        """Whether ``session`` is registered."""
        with self._lock:
            return session in self._regs

    def silent(self, now: float | None = None) -> list[tuple[str, float]]:
        """The sessions silent at ``now`` (this table's clock; by default the present) for
        longer than their :func:`silence_limit`, each with how long it has been silent (s)."""
        now = self._clock() if now is None else now
        with self._lock:
            return [(s, now - self._heard[s]) for s, reg in self._regs.items()
                    if (limit := silence_limit(reg)) is not None and now - self._heard[s] > limit]

    def destination(self, dest: wire.Destination) -> list[Owed]:
        """Attach ``dest`` to its room, or keep it until the room's sender exists; for a room
        that failed before its handshake or was refused, the refusal owed to decode instead.
        Raises :class:`AnsweredDrop` for a destination dropped from a registered session (the
        early destinations it evicted, for one that made the early store overflow), and
        :class:`~kv.wire.WireError` for one from a session that is not registered."""
        with self._lock:
            if dest.session not in self._regs:
                raise wire.WireError("unknown_session",
                                     f"room {dest.room}: session {dest.session!r}")
            # Attached or answered, its room's news reaches the session as this destination's.
            self._watchers.drop(dest.room, dest.session)
            if self._withdrawn.pop(dest.room, dest.session):
                raise self._dropped(dest, wire.WireError(
                    "stale_room", f"room {dest.room}: session {dest.session} aborted it "
                                  "before its destination came"))
            rec = self._rooms.get(dest.room)
            if rec is not None and self._has_leg(rec, dest.session):
                raise self._dropped(dest, wire.WireError(
                    "duplicate_destination",
                    f"room {dest.room}: a second one from session {dest.session}"))
            try:
                wire.check_destination(dest, self._regs)
            except wire.WireError as err:
                raise self._dropped(dest, err) from None
            unfit = self._targets[dest.session].state.refused
            if unfit and (rec is None or not rec.paired):
                return self._refuse_state(rec, dest, unfit)
            if rec is not None and not rec.paired:
                if rec.status == KVPoll.FAILED:
                    return self._answer(dest, rec.told or rec.reason)
                self._take(rec, dest)
                return []
            refused = self._refused.get(dest.room)
            if refused is not None:
                return self._answer(dest, refused)
            if rec is not None:
                raise self._dropped(dest, wire.WireError("duplicate_destination",
                                                         f"room {dest.room}"))
            self._answered.pop((dest.room, dest.session), None)  # a new use of the room
            evicted = self._early.keep(dest)
            if evicted:
                raise self._evicted(evicted)
            return []

    def watch(self, msg: wire.Watch) -> list[Owed]:
        """``msg.session`` holds ``msg.room`` and has no pages for it yet: a room refused or
        failed before its destination is owed to it now, one that fails later when it does.
        Raises :class:`~kv.wire.WireError` for a session that is not registered."""
        with self._lock:
            if msg.session not in self._regs:
                raise wire.WireError("unknown_session",
                                     f"watch of room {msg.room}: session {msg.session!r}")
            rec = self._rooms.get(msg.room)
            if rec is not None and any(leg.session == msg.session for leg in rec.legs.values()):
                return []  # its destination came: the room's statuses reach it as a leg's
            self._watchers.add(msg.room, msg.session)
            if rec is None:
                refused = self._refused.get(msg.room)
                if refused is None or _ended_by_decode(refused):
                    return []
                return self._owe_watchers(msg.room, refused)
            if rec.notified and not _ended_by_decode(rec.reason):  # failed and settled before
                return self._owe_watchers(msg.room, rec.told or rec.reason)
            return []

    def refuse(self, room: int, reason: str) -> list[Owed]:
        """This rank will not serve ``room``: a destination for it, already waiting or still
        to come, is answered with the refusal, and a decode rank watching it is told now (the
        statuses owed now)."""
        with self._lock:
            self._refused.add(room, reason)
            owed = [self._refusal(d, reason) for d in self._early.take(room)]
            if room not in self._rooms:  # a live room's request is not the one refused
                owed += self._owe_watchers(room, reason)
            return owed

    def peer_refused(self, room: int, reason: str) -> list[Owed]:
        """A decode rank will never send ``room``'s destination: the room fails now if it
        still waits for one, or when it is created (a room that has all its destinations is
        paired; decode aborts those with an ``Abort``)."""
        with self._lock:
            self._watchers.forget(room)
            rec = self._rooms.get(room)
            if rec is None:
                self._peer_refused.add(room, reason)
            elif not rec.paired and self._fail(rec, refusal(reason)):
                return self._settle(rec)  # the decode ranks that did give theirs
            return []

    def peer_abort(self, msg: wire.Abort) -> list[Owed]:
        """Decode aborted a room: a live room holding the session's destination fails (its
        statuses are owed once it is quiescent), an early one is withdrawn and answered, and
        any other abort is answered with a FAILED ``Status`` (nothing of this rank writes into
        that destination), or, where the session was answered already since its destination
        came, with that answer again (:class:`Repeated`; ``stale_room`` where it is yet to be
        sent, or none is owed). An abort answered with a FAILED ``Status`` may have overtaken
        its destination: that destination, when it comes, is answered and never attached; a
        live room still waiting for it fails now, and a room not created yet fails when it is.
        A repeat withdraws nothing (decode never takes one for a use whose ``Abort`` went out
        before its destination: :mod:`kv.mooncake_decode`). Raises ``unknown_session`` for a
        session that is not registered."""
        with self._lock:
            if msg.session not in self._regs:
                raise wire.WireError("unknown_session",
                                     f"abort of room {msg.room}: session {msg.session!r}")
            rec = self._rooms.get(msg.room)
            if rec is None and self._early.withdraw(msg.room, msg.session):
                # Never reached this rank: nothing is written; decode learns its pages are
                # free, and a sender created later for the room fails at once.
                self._peer_refused.add(msg.room, REASON_PEER_ABORTED)
                return [self._owe(msg.session, msg.room, KVPoll.FAILED, REASON_PEER_ABORTED)]
            if rec is not None and self._has_leg(rec, msg.session):
                if self._fail(rec, REASON_PEER_ABORTED):
                    return self._settle(rec)
                if rec.status == KVPoll.FAILED and not rec.notified:
                    return []  # still being written: answered once quiescent
            if (msg.room, msg.session) in self._answered:
                return self._again(msg.room, msg.session)
            if rec is None or not self._has_leg(rec, msg.session):
                self._withdrawn.add(msg.room, msg.session)
            owed = [self._owe(msg.session, msg.room, KVPoll.FAILED, REASON_PEER_ABORTED)]
            if rec is None:
                self._peer_refused.add(msg.room, REASON_PEER_ABORTED)
            elif (not rec.paired and self._waits_for(rec, self._targets[msg.session])
                  and self._fail(rec, REASON_PEER_ABORTED)):
                owed += self._settle(rec)  # the decode ranks that did give theirs
            return owed

    def deregister(self, session: str, reason: str | None = None) -> list[Owed]:
        """Forget ``session``, whose decode manager closed (or, with ``reason``, that went
        silent or registered anew): its live rooms fail, its early destinations are answered
        and a room it sent one for fails when its sender is created, and a later message from
        it is dropped as from an unknown session (a ``Register`` makes it known again). The
        statuses owed, the session's own among them (the caller pushes them before it closes
        the session's socket, or hands those back to :meth:`not_told`). Raises
        ``unknown_session`` for a session that is not registered."""
        with self._lock:
            if session not in self._regs:
                raise wire.WireError("unknown_session", f"deregister from {session!r}")
            reason = reason or f"decode session {session} closed"
            self._watchers.forget_session(session)
            owed = [self._owe(session, dest.room, KVPoll.FAILED, reason)
                    for dest in self._early.withdraw_session(session)]
            for o in owed:
                self._peer_refused.add(o.room, reason)
            owed += self._fail_session(session, reason)
            del self._regs[session], self._targets[session], self._heard[session]
            self._blacklist.discard(session)
            return owed

    def not_told(self, owed: Sequence[Owed]) -> None:
        """The statuses of ``owed`` could not be sent: an ``Abort`` of one of those rooms
        from its session is answered."""
        with self._lock:
            for o in owed:
                self._answered.pop((o.room, o.session), None)

    def close(self, reason: str, *, every_session: bool = False) -> dict[str, float]:
        """This rank serves no room any more (``reason``): every live room fails, and so does
        a room created from now on, at once. Decode is told nothing: its heartbeat fails the
        rooms of a prefill that stopped answering (and refuses them to the instance that
        answers next, which a status would forestall). The decode sessions left holding pages
        for a destination of this rank that no ``Status`` answered (a room live until now, or
        failed and not yet told, or a destination kept for a room not created), each with how
        often it checks the prefill's health (its keepalive, seconds; 0: it sends none); with
        ``every_session`` (control messages came that no one read), every registered one."""
        with self._lock:
            self._closed = reason
            unanswered: set[str] = set()
            for rec in self._rooms.values():
                self._fail(rec, reason)
                if rec.status == KVPoll.FAILED and not rec.notified:
                    unanswered.update(leg.session for leg in rec.legs.values())
            for session in self._regs:
                if self._early.withdraw_session(session) or every_session:
                    unanswered.add(session)
            return {s: self._regs[s].keepalive_ms / 1000 if s in self._regs else 0.0
                    for s in unanswered}

    # -- senders (scheduler thread) ------------------------------------------------------------

    def create(self, room: int) -> tuple[PrefillRoom, list[Owed]]:
        """A new room, with the destinations that came early; a room decode refused fails at
        once, and the decode ranks that did send a destination are owed the refusal; a room
        created once the table closed fails at once. An early destination the room cannot take
        (not from a decode rank it serves, a second one) is answered."""
        with self._lock:
            if room in self._rooms:
                raise TransferUsageError(room, "a live sender exists for this room; clear() it")
            rec = PrefillRoom(room=room, created=self._clock())
            self._rooms[room] = rec
            if self._closed:
                self._fail(rec, self._closed)
                return rec, []
            early = self._early.take(room)
            refused = self._peer_refused.pop(room)
            if refused is not None:
                self._fail(rec, refusal(refused))
                return rec, [self._refusal(dest, refused) for dest in early]
            overflowed = self._overflowed.pop(room)
            if overflowed is not None:
                self._fail(rec, overflowed)
                return rec, [*(self._refusal(dest, overflowed) for dest in early),
                             *self._settle(rec)]
            owed: list[Owed] = []
            for dest in early:
                try:
                    self._accept(rec, dest)
                except wire.WireError as exc:  # counted where it came in: it was kept then
                    logger.warning("early destination of room %d dropped: %s", room, exc)
                    owed += self._dropped(dest, exc).owed
        return rec, owed

    def init(self, rec: PrefillRoom, num_pages: int, slot: int) -> list[Owed]:
        if not 0 <= slot < self._num_slots:
            raise TransferUsageError(rec.room, f"slot {slot} not in 0..{self._num_slots - 1}")
        with self._lock:
            if not accepts_call(rec.room, rec.status, "init()", ready=rec.paired):
                return []
            rec.cursor.init(num_pages, slot)
            # Fewer pages cannot hold the prompt; more mean the decode was sent a longer one,
            # whose pages beyond ours would be read unwritten (the halves disagree).
            unlike = [leg for leg in rec.legs.values() if len(leg.dest.pages) != num_pages]
            if not unlike:
                return []
            self._fail(rec, f"decode session {unlike[0].session} offered "
                            f"{len(unlike[0].dest.pages)} pages, the request needs {num_pages}"
                            " (were the two workers sent the same prompt?)")
            return self._settle(rec)

    def set_state(self, rec: PrefillRoom, state: dict[StateKind, list[int]]) -> None:
        """The last chunk's state items (``send_state``), ignored once the room failed."""
        with self._lock:
            if rec.status == KVPoll.FAILED:
                return
            if rec.cursor.num_pages is None or rec.cursor.finished:
                raise TransferUsageError(rec.room, "send_state() before init() or after the "
                                                   "last chunk")
            rec.state = state

    def chunk(self, rec: PrefillRoom, pages: Sequence[int], last: bool
              ) -> tuple[list[Chunk], list[Owed]]:
        """The chunks to write for ``send(pages, last)``, one per decode rank this rank writes
        into, and the statuses owed; none for a failed room or an empty chunk that is not the
        last. A status-only rank's room succeeds with its last chunk, having written nothing. A
        last chunk whose state items do not pair with a destination's fails the room."""
        with self._lock:
            if rec.status == KVPoll.FAILED:
                return [], []
            if rec.cursor.num_pages is None or not rec.paired:
                raise TransferUsageError(rec.room, f"send() before init() while {rec.status.name}")
            span = rec.cursor.advance(len(pages), last)
            if not self._live(rec) or (not pages and not last):
                return [], []
            writers = rec.writers
            unpaired = [pairing(rec.state, leg.dest.state) for leg in writers] if last else []
            why = next(filter(None, unpaired), "")
            if why:
                self._fail(rec, f"the last chunk's state does not fit the destination: {why}")
                return [], self._settle(rec)
            rec.status = KVPoll.TRANSFERRING
            if not writers and last:
                rec.status = KVPoll.SUCCESS
                self.ready.put(rec.room)
            rec.in_flight += len(writers)
            state = rec.state if last else {}
            return [Chunk(rec, leg, list(pages), leg.dest.pages[span], last, state)
                    for leg in writers], []

    def poll(self, rec: PrefillRoom) -> tuple[KVPoll, list[Owed]]:
        """The room's status, and the statuses owed (:meth:`expire`'s, for this room)."""
        with self._lock:
            owed = self._expire(rec)
            return rec.status, owed

    def expire(self) -> list[Owed]:
        """Fail every room still BOOTSTRAPPING past the bootstrap timeout (its readiness goes
        to :attr:`ready`, so its owner sees it without polling it); the decode ranks that gave
        their destination or watch the room are owed the failure."""
        with self._lock:
            return [o for rec in list(self._rooms.values()) for o in self._expire(rec)]

    def watched(self) -> list[int]:
        """The rooms decode ranks watch, oldest watch first (a leak check: none once every
        room ended on both sides)."""
        with self._lock:
            return self._watchers.rooms()

    def failure(self, rec: PrefillRoom) -> TransferError:
        with self._lock:
            return TransferError.reported(rec.room, rec.status, rec.reason, rec.sessions,
                                          timeout=rec.timed_out)

    def fail(self, rec: PrefillRoom, reason: str, *, told: str = "") -> list[Owed]:
        """Fail the room (its sender aborted it); the statuses owed to decode. ``told``: what
        decode is told instead of ``reason``, as a refusal (see ``MooncakeKVSender.abort``)."""
        with self._lock:
            if self._fail(rec, reason):
                rec.told = told
            return self._settle(rec)

    def clear(self, rec: PrefillRoom) -> list[Owed]:
        """Forget the room; one not concluded is aborted first, so the decode ranks whose
        destination it holds are still told (now, or once it is quiescent). The statuses
        owed."""
        with self._lock:
            if self._rooms.get(rec.room) is not rec:
                return []
            owed = self._settle(rec) if self._fail(rec, REASON_ABORTED) else []
            del self._rooms[rec.room]
            for leg in rec.legs.values():  # told, or to be told once quiescent
                self._mark(rec.room, leg.session)
            # Failed before decode's destinations came: a late one gets the refusal, also
            # where decode refused the room (a decode rank's destination may still be on its
            # way, and must not wait for a later use of the room number).
            if not rec.paired and rec.status == KVPoll.FAILED:
                self._refused.add(rec.room, rec.told or rec.reason)
            return owed

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
        """Chunks written to ``session`` are done: with ``error`` their rooms fail, else a room
        whose last chunk reached every decode rank it writes into succeeds (and each of them is
        told); a failed engine write blacklists the session. The statuses owed."""
        owed: list[Owed] = []
        with self._lock:
            for chunk in chunks:
                rec = chunk.rec
                rec.in_flight -= 1
                if error is not None:
                    self._fail(rec, error)
                elif chunk.last and self._live(rec):
                    rec.written.add(chunk.leg.target.decode_rank)
                    writers = rec.writers
                    if len(rec.written) == len(writers):
                        rec.status = KVPoll.SUCCESS
                        self.ready.put(rec.room)
                        owed += [self._owe(leg.session, rec.room, KVPoll.SUCCESS)
                                 for leg in writers]
            if engine_failed and session not in self._blacklist:
                self._blacklist.add(session)
                owed += self._fail_session(
                    session, f"decode session {session} was blacklisted after a failed transfer")
            for chunk in chunks:
                owed += self._settle(chunk.rec)
        return owed

    # -- callers hold self._lock -----------------------------------------------------------------

    def _owe(self, session: str, room: int, poll: KVPoll, reason: str = "") -> Owed:
        """The ``Status`` owed to ``session`` for ``room``, remembered as its answer."""
        self._mark(room, session, (poll, reason))
        return Owed(session, room, poll, reason)

    def _mark(self, room: int, session: str, answer: tuple[KVPoll, str] | None = None) -> None:
        """Remember that ``session``'s destination of ``room`` is answered (with ``answer``,
        the ``Status`` sent; None keeps the one remembered, if any)."""
        key = (room, session)
        if answer is not None or key not in self._answered:
            self._answered[key] = answer
        self._answered.move_to_end(key)
        while len(self._answered) > _ANSWERED:
            self._answered.popitem(last=False)

    def _again(self, room: int, session: str) -> list[Owed]:
        """``session``'s ``Abort`` of ``room`` came after the room's ``Status`` to it was sent:
        that ``Status`` again (:class:`Repeated`), for the first may have been lost on the way
        (a connection torn down with messages queued) and decode holds the room's pages until
        one comes. Raises ``stale_room`` where none was sent yet (the room's is still to be
        sent, once it is quiescent; or none is owed: a status-only rank's success)."""
        answer = self._answered[(room, session)]
        if answer is None:
            raise wire.WireError("stale_room", f"abort of room {room}: its status is yet to "
                                               "be sent, or none is owed")
        self._answered.move_to_end((room, session))
        return [Repeated(session, room, *answer)]

    def _refusal(self, dest: wire.Destination, reason: str) -> Owed:
        return self._owe(dest.session, dest.room, KVPoll.FAILED, _as_refusal(reason))

    @staticmethod
    def _has_leg(rec: PrefillRoom, session: str) -> bool:
        return any(leg.session == session for leg in rec.legs.values())

    def _take(self, rec: PrefillRoom, dest: wire.Destination) -> None:
        """:meth:`_accept` ``dest`` as it comes, raising :class:`AnsweredDrop` for one the
        room cannot take."""
        try:
            self._accept(rec, dest)
        except wire.WireError as err:
            raise self._dropped(dest, err) from None
        self._answered.pop((dest.room, dest.session), None)  # a new use of the room

    def _dropped(self, dest: wire.Destination, err: wire.WireError) -> AnsweredDrop:
        """``err``, the drop of ``dest``, with the FAILED ``Status`` its session is owed for
        it: none while a destination of the session for the room is held here (a leg of the
        live room, an early one), which is answered in its turn, or for a session already
        told of the room through its watch."""
        rec = self._rooms.get(dest.room)
        held = (rec is not None and self._has_leg(rec, dest.session)) or self._early.holds(
            dest.room, dest.session)
        owed = [] if held else self._answer_plain(dest, f"destination dropped: {err}")
        return AnsweredDrop(err, owed)

    def _evicted(self, evicted: Sequence[wire.Destination]) -> AnsweredDrop:
        """The early destinations of one room, evicted (one room too many waited for its
        sender): each is answered, the decode ranks watching the room are told, a later
        destination or watch for it is answered with the refusal, and a sender created for
        the room later fails at once, for this rank's own limit (not as a decode refusal)."""
        room = evicted[0].room
        why = (f"early_overflow: this prefill rank keeps the early destinations of at most "
               f"{self._early.limit} rooms (max_early_destinations); room {room}'s were dropped")
        self._refused.add(room, why)
        self._overflowed.add(room, why)
        owed = [o for dest in evicted for o in self._answer_plain(dest, why)]
        owed += self._owe_watchers(room, why)
        return AnsweredDrop(wire.WireError("early_overflow", f"evicted early room {room}"), owed)

    def _answer_plain(self, dest: wire.Destination, reason: str) -> list[Owed]:
        """A FAILED ``Status`` with ``reason`` (not a refusal) answering ``dest``, unless its
        session's watch was told of the room already."""
        if self._watchers.was_told(dest.room, dest.session):
            return []
        return [self._owe(dest.session, dest.room, KVPoll.FAILED, reason)]

    def _expire(self, rec: PrefillRoom) -> list[Owed]:
        if rec.status != KVPoll.BOOTSTRAPPING:
            return []
        waited = self._clock() - rec.created
        if waited < self._bootstrap_timeout_s:
            return []
        self._fail(rec, f"no destination from decode after {waited:.1f}s (bootstrap timeout)",
                   timed_out=True)
        return self._settle(rec)

    def _answer(self, dest: wire.Destination, reason: str) -> list[Owed]:
        """The refusal that answers ``dest``, unless its session's watch was told already."""
        if self._watchers.was_told(dest.room, dest.session):
            return []
        return [self._refusal(dest, reason)]

    def _owe_watchers(self, room: int, reason: str, skip: frozenset[str] = frozenset()
                      ) -> list[Owed]:
        """The refusal of ``room`` owed to every decode rank watching it, but ``skip``."""
        return [self._owe(session, room, KVPoll.FAILED, _as_refusal(reason))
                for session in self._watchers.take(room, skip)]

    def _accept(self, rec: PrefillRoom, dest: wire.Destination) -> None:
        """Add ``dest`` as a leg of ``rec``; the room waits for its input once every decode
        rank it serves gave its destination."""
        target = self._targets[dest.session]
        waits_for = rec.waits_for or target.waits_for
        rank = target.decode_rank
        if not self._waits_for(rec, target):
            raise wire.WireError(
                "not_a_contact", f"room {dest.room}: decode rank {rank} of session "
                f"{dest.session} is not one of the ranks {waits_for} this rank serves")
        if rank in rec.legs:
            raise wire.WireError("duplicate_destination",
                                 f"room {dest.room}: a second one from decode rank {rank}")
        rec.waits_for = waits_for
        rec.legs[rank] = Leg(dest, target)
        if rec.paired and rec.status == KVPoll.BOOTSTRAPPING:
            rec.status = KVPoll.WAITING_FOR_INPUT
            self.ready.put(rec.room)

    @staticmethod
    def _waits_for(rec: PrefillRoom, target: Target) -> bool:
        """Whether ``rec`` serves the decode rank of ``target`` (the ranks of one TP layout:
        those of its first destination)."""
        waits_for = rec.waits_for or target.waits_for
        return target.waits_for == waits_for and target.decode_rank in waits_for

    def _refuse_state(self, rec: PrefillRoom | None, dest: wire.Destination,
                      reason: str) -> list[Owed]:
        """A destination from a decode rank whose state pools this rank cannot serve: the
        room fails on both sides, now or when its sender is created."""
        if rec is None:
            self._peer_refused.add(dest.room, reason)
            return [self._refusal(dest, reason)]
        self._fail(rec, refusal(reason))
        return [self._refusal(dest, reason), *self._settle(rec)]

    def _fail(self, rec: PrefillRoom, reason: str, *, timed_out: bool = False) -> bool:
        if rec.status.terminal:
            return False
        rec.status = KVPoll.FAILED
        rec.reason = reason
        rec.timed_out = timed_out
        self.ready.put(rec.room)
        return True

    def _settle(self, rec: PrefillRoom) -> list[Owed]:
        """The FAILED statuses owed to every decode rank of a failed room once it is
        quiescent, if any."""
        if rec.status != KVPoll.FAILED or rec.in_flight or rec.notified:
            return []
        rec.notified = True
        if _ended_by_decode(rec.reason):
            self._watchers.forget(rec.room)  # it knows
            watchers = []
        else:
            watchers = self._owe_watchers(rec.room, rec.told or rec.reason,
                                          frozenset(leg.session for leg in rec.legs.values()))
        if not rec.legs:
            return watchers
        self.ready.put(rec.room)  # quiescence is news to the owner of the pages
        reason = refusal(rec.told) if rec.told else rec.reason
        return [*(self._owe(leg.session, rec.room, KVPoll.FAILED, reason)
                  for leg in rec.legs.values()), *watchers]

    def _fail_session(self, session: str, reason: str) -> list[Owed]:
        """Fail every live room with a leg to ``session`` (blacklisted or gone: none of them
        can succeed)."""
        failed = [r for r in self._rooms.values()
                  if any(leg.session == session for leg in r.legs.values())
                  and self._fail(r, reason)]
        return [o for r in failed for o in self._settle(r)]

    def _live(self, rec: PrefillRoom) -> bool:
        return self._rooms.get(rec.room) is rec and not rec.status.terminal
