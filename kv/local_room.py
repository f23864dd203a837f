"""The local backend's room state: each end's :class:`Side`, and the :class:`RoomGroup` that owns
every end of one room across the ranks of both sides.

Theory of operation
-------------------
A room of one prefill server involves one sender per prefill rank that serves it (every TP rank
of every pipeline stage of its DP replica) and one receiver per decode TP rank. Every end joins
the room's *current* group (:meth:`kv.local.LocalServer.group`) when it appears: a sender when it
is created, a receiver when it sends its destination. From then on the group is the one owner of
all their state, under the hub's lock:

- *Pairing.* A receiver names the prefill ranks it contacts and the ones whose writes it waits
  for (:func:`kv.routes.route_places`). A sender learns the decode layout from the first
  receiver that contacts it (:func:`kv.routes.sender_duty`) and leaves BOOTSTRAPPING once it
  holds the destination of every decode rank it owes.
- *Completion.* A sender concludes SUCCESS when its last chunk landed in every destination (a
  status-only sender at its last ``send``, without writing); a receiver when every source rank
  concluded and the metadata row (written by one source of the last stage) landed.
- *Failure.* A failure anywhere fails every end of the group, now and any that joins later
  (:class:`Failure` says which reason each end gets: the end that aborted reports ``aborted``,
  the other side ``aborted by the peer``, its own side's other ranks ``failed on another
  rank``). Terminal states latch. A failed end is announced again when it becomes quiescent.

Watchers: a decode receiver that resolved its route but has no pages yet (its request waits for
them) watches the room's current group (:class:`Watcher`): a failure that starts on the prefill
side (a refusal, an abort, a failed handshake) fails it at once, as it would fail a receiver
that joined, instead of when its destination comes. It joins the group as a receiver when it
sends its destination.

Generations: a room number is reused once both sides are done with it. A cleared sender leaves
its group and retires it (later ends form a new group), so a late abort from an old receiver
reaches only the old group. A receiver for a decode rank that a sender of the current group
already paired with starts a new group as well; one that replaces a receiver no sender took yet
supersedes it (the old receiver fails alone). A cleared receiver leaves its group; a group
without members is forgotten, a failure with nobody left to tell recorded as a refusal by the
server (:mod:`kv.refusal`).
"""

from __future__ import annotations

import logging
import queue

import attrs

from kv.metadata import MetadataBuffers
from kv.pool import KVPool
from kv.rank_table import RankPlace
from kv.routes import SenderDuty, sender_duty
from kv.state_pools import StateKind, StatePools
from kv.transfer import KVPoll

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"


@attrs.define(eq=False)
class Side:
    """What one end of a room reports: its status and why it failed. Changed only under the
    hub's lock; every change is announced on the end's ``ready`` queue (unless ``muted``: a
    cleared receiver is no one's news)."""

    room: int
    ready: queue.SimpleQueue[int] = attrs.field(repr=False)
    end: str  # PREFILL or DECODE
    status: KVPoll = KVPoll.BOOTSTRAPPING
    reason: str = ""
    muted: bool = False

    def set(self, status: KVPoll) -> None:
        self.status = status
        self.announce()

    def fail(self, reason: str) -> None:
        if self.status.terminal:
            return
        self.reason = reason
        logger.debug("local %s room %d failed: %s", self.end, self.room, reason)
        self.set(KVPoll.FAILED)

    def announce(self) -> None:
        if not self.muted:
            self.ready.put(self.room)


@attrs.define(eq=False)
class SenderEnd:
    """One prefill rank's end of a room."""

    side: Side
    rank: int  # the prefill rank's number in its server
    place: RankPlace
    duty: SenderDuty | None = None
    dests: dict[int, ReceiverEnd] = attrs.Factory(dict)  # decode TP rank -> its receiver
    inflight: int = 0  # chunks queued or being copied
    # What the decode side is told instead of the end's own reason (``abort(why)``), also by
    # the refusal a late destination gets.
    told: str = ""

    @property
    def paired(self) -> bool:
        """Every destination this rank owes arrived."""
        return self.duty is not None and len(self.dests) == len(self.duty.destinations)


@attrs.define(eq=False)
class ReceiverEnd:
    """One decode rank's end of a room: where its pages go and whom it waits for."""

    side: Side
    place: RankPlace
    pool: KVPool
    metadata: MetadataBuffers
    pages: list[int]
    slot: int
    contacts: frozenset[int]  # prefill ranks that get this destination
    sources: frozenset[int]  # prefill ranks whose success completes the room here
    row_writer: int  # the source that writes the metadata row
    done: set[int] = attrs.Factory(set)
    row_landed: bool = False
    taken: bool = False  # a sender paired with it
    inflight: int = 0  # chunks queued or being copied into its pages
    states: StatePools | None = None  # a hybrid model's state pools (kv/state_pools.py)
    state: dict[StateKind, list[int]] = attrs.Factory(dict)  # where each kind's state goes


End = SenderEnd | ReceiverEnd


@attrs.define(eq=False)
class Watcher:
    """A decode rank's receiver that holds a room but sent no destination yet."""

    side: Side
    contacts: frozenset[int]  # the prefill ranks its destination will go to


@attrs.frozen
class Failure:
    """Why a group failed, and what each end reports."""

    origin: str  # the side whose end failed first (PREFILL or DECODE)
    own: str  # that end's reason
    peer: str  # the other side's ends'
    sibling: str  # the origin side's other ends'

    @classmethod
    def everywhere(cls, origin: str, reason: str) -> Failure:
        return cls(origin, reason, reason, reason)

    def reason_for(self, end: End) -> str:
        return self.sibling if end.side.end == self.origin else self.peer


class RoomGroup:
    """Every end of one room of one prefill server, and the one owner of their state (every
    method is called under the hub's lock)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.senders: dict[int, SenderEnd] = {}
        self.receivers: dict[int, ReceiverEnd] = {}
        self.failure: Failure | None = None
        self.retired = False
        self.taken_ranks: set[int] = set()  # decode ranks a sender paired with
        self.watchers: dict[int, Watcher] = {}  # decode TP rank -> its receiver before joining

    @property
    def empty(self) -> bool:
        return not self.senders and not self.receivers and not self.watchers

    def contacted(self, rank: int) -> bool:
        """Whether a receiver or watcher of the group names prefill rank ``rank``."""
        return (any(rank in r.contacts for r in self.receivers.values())
                or any(rank in w.contacts for w in self.watchers.values()))

    def ends(self) -> list[End]:
        return [*self.senders.values(), *self.receivers.values()]

    # -- joining ---------------------------------------------------------------------------

    def join_sender(self, sender: SenderEnd) -> None:
        self.senders[sender.rank] = sender
        if self.failure is not None:
            sender.side.fail(self.failure.reason_for(sender))
            return
        self.pair()

    def join_receiver(self, receiver: ReceiverEnd) -> None:
        rank = receiver.place.tp_rank
        old = self.receivers.get(rank)
        if old is not None:
            old.side.fail(f"superseded by another receiver for room {self.room}")
        self.receivers[rank] = receiver
        if self.failure is not None:
            receiver.side.fail(self.failure.reason_for(receiver))
            return
        receiver.side.set(KVPoll.TRANSFERRING)
        self.pair()

    def watch(self, tp_rank: int, watcher: Watcher) -> None:
        """``watcher`` waits for pages; a failure that started on the prefill side fails it
        now or when it happens."""
        if self.failure is not None and self.failure.origin == PREFILL:
            watcher.side.fail(self.failure.peer)
            return
        self.watchers[tp_rank] = watcher

    def unwatch(self, tp_rank: int, watcher: Watcher) -> None:
        if self.watchers.get(tp_rank) is watcher:
            del self.watchers[tp_rank]

    def pair(self) -> None:
        """Hand every sender the destinations of the receivers that contact it."""
        for sender in self.senders.values():
            if sender.side.status != KVPoll.BOOTSTRAPPING:
                continue
            for receiver in self.receivers.values():
                if sender.rank in receiver.contacts and not receiver.side.status.terminal:
                    problem = self._take(sender, receiver)
                    if problem:
                        self.fail(Failure.everywhere(PREFILL, problem))
                        return
            if sender.paired:
                sender.side.set(KVPoll.WAITING_FOR_INPUT)

    def _take(self, sender: SenderEnd, receiver: ReceiverEnd) -> str:
        d = receiver.place.tp_rank
        if sender.duty is None:
            sender.duty = sender_duty(sender.place, receiver.place)
        elif sender.duty.plan.decode != receiver.place.tp_layout:
            return (f"decode ranks of room {self.room} disagree on their layout: "
                    f"{sender.duty.plan.decode} vs {receiver.place.tp_layout}")
        if d not in sender.duty.destinations:
            return (f"decode rank {d} contacted prefill rank {sender.rank}, which sends to "
                    f"decode ranks {list(sender.duty.destinations)}")
        sender.dests[d] = receiver
        receiver.taken = True
        self.taken_ranks.add(d)
        return ""

    # -- failing ---------------------------------------------------------------------------

    def fail(self, failure: Failure, origin: End | None = None) -> None:
        """Fail every end (``origin`` with ``failure.own``); ends that join later fail too."""
        if self.failure is None:
            self.failure = failure
        if origin is not None:
            origin.side.fail(failure.own)
        for end in self.ends():
            if end is not origin:
                end.side.fail(failure.reason_for(end))
        if failure.origin == PREFILL:
            for watcher in self.watchers.values():
                watcher.side.fail(failure.peer)

    def abort(self, end: End, peer_reason: str, own: str, sibling: str) -> None:
        """``end`` aborted: nothing once it concluded; otherwise the whole group fails."""
        if end.side.status.terminal:
            return
        self.fail(Failure(end.side.end, own, peer_reason, sibling), origin=end)

    # -- chunks ----------------------------------------------------------------------------

    def queue_chunk(self, sender: SenderEnd) -> None:
        sender.inflight += 1
        for receiver in sender.dests.values():
            receiver.inflight += 1
        sender.side.status = KVPoll.TRANSFERRING

    @staticmethod
    def copying(sender: SenderEnd, cleared: bool) -> bool:
        """Whether a queued chunk is still wanted: the transfer is on and the sender live."""
        return sender.side.status == KVPoll.TRANSFERRING and not cleared

    def chunk_done(self, sender: SenderEnd, *, copied: bool, last: bool, error: str) -> None:
        sender.inflight -= 1
        for receiver in sender.dests.values():
            receiver.inflight -= 1
        if error:
            self.fail(Failure.everywhere(PREFILL, error))
        elif copied and last and sender.side.status == KVPoll.TRANSFERRING:
            self.sender_finished(sender)
        self.announce_quiescent(sender)

    def sender_finished(self, sender: SenderEnd) -> None:
        """``sender`` wrote its last chunk (or, status-only, had nothing to write)."""
        sender.side.set(KVPoll.SUCCESS)
        for receiver in sender.dests.values():
            receiver.done.add(sender.rank)
            if sender.rank == receiver.row_writer:
                receiver.row_landed = True
            if (receiver.done >= receiver.sources and receiver.row_landed
                    and receiver.side.status == KVPoll.TRANSFERRING):
                receiver.side.set(KVPoll.SUCCESS)

    def announce_quiescent(self, sender: SenderEnd) -> None:
        """A failed end whose pages no copy touches any more: its owner may free them."""
        if sender.inflight == 0 and sender.side.status == KVPoll.FAILED:
            sender.side.announce()
        for receiver in sender.dests.values():
            if receiver.inflight == 0 and receiver.side.status == KVPoll.FAILED:
                receiver.side.announce()
