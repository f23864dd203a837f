"""The transfer contract every backend (fake, local, mooncake) implements.

Theory of operation
-------------------
The prefill side has one :class:`KVManager` per rank and one :class:`KVSender` per request,
keyed by the request's bootstrap room. The decode side has one :class:`DecodeKVManager` per
rank and one :class:`KVReceiver` per request. The states a sender or receiver reports are
:class:`KVPoll`, whose integer order is load-bearing: ranks combine polls with MIN so that the
most pessimistic state wins (any rank FAILED means everyone sees FAILED; all must be SUCCESS).

Sender protocol (prefill):
1. ``manager.create_sender(addr, room)`` — the sender starts in BOOTSTRAPPING.
2. The decode peer's destination for the room arrives: ``poll()`` → WAITING_FOR_INPUT.
3. ``init(num_pages, slot)`` declares how many pages the request will send in total and which
   metadata-buffer row carries its first token. Only legal once the sender has reported
   WAITING_FOR_INPUT.
4. ``send(pages, last)`` once per chunk; ``last=True`` on the final chunk, which also ships the
   metadata row; by then exactly ``num_pages`` pages must have been sent (a zero-page request
   sends one empty last chunk). The backend concludes SUCCESS only after every declared page
   and the metadata row were written.
5. ``poll()`` → WAITING_FOR_INPUT until the first send, TRANSFERRING while work is outstanding,
   then SUCCESS or FAILED. Terminal states latch: ``abort()`` after SUCCESS changes nothing.
6. ``clear()`` forgets the room; a late message for a cleared room is ignored, so a reused room
   is never poisoned. A sender is not used after ``clear()`` except for ``quiescent()``.

Misuse by the caller (init before the handshake, pages beyond ``num_pages``, a last chunk that
leaves pages unsent, two live senders for one room) raises :class:`TransferUsageError`: it is
a bug in the caller, not a request failure. Once a sender has FAILED (aborted, or failed by the
backend or the peer), ``init`` and ``send`` are accepted and ignored, because the caller may
learn of the failure only after it issued them.

Failures: ``failure_exception()`` returns a :class:`TransferError` carrying the room and the
recorded reason; when the sender did not fail itself (the failure came from another rank
through the MIN) the reason is :data:`REASON_OTHER_RANK`. A room aborted on its own side reports
:data:`REASON_ABORTED`; a sender whose room the decode side aborted reports
:data:`REASON_PEER_ABORTED` (so the prefill scheduler answers an abort, not a transfer failure),
and so does a local-backend receiver whose room the prefill side aborted. A sender aborted with
a reason for the client (``abort(why)``: the request failed for a reason the client is to see,
such as a grammar the engine cannot run) fails the peer's end with :func:`refusal` of ``why``.

Refusals (no stranded peer): a side that refuses a request, or fails it before the handshake,
tells its peer, which fails its own request for the room at once with :func:`refusal` of the
reason (``peer refused: draining``) instead of waiting for a timeout. Prefill keeps a short-lived
record of such rooms (:meth:`KVManager.refuse`, and every room that fails before its destination
came) and answers a destination for one with the refusal; decode tells prefill's control plane
(:meth:`DecodeKVManager.refuse`), and a room prefill learns of that way fails at once, or as soon
as its sender is created. ``TransferError.refused`` tells such a failure apart.

Readiness is pushed: whenever a sender's poll result may have changed (handshake arrived,
transfer concluded, failure), and when a failed sender becomes quiescent, the manager puts its
room on :attr:`KVManager.ready`, a thread-safe queue the scheduler drains, so a scheduler pass
polls only the senders that changed. The queue may carry duplicates and rooms the consumer no
longer tracks; consumers ignore those. A backend whose state advances by being polled (the
fake's configured delays) re-announces the room from ``poll()``, so a consumer drains the
number of items present when it starts draining (one snapshot per pass), not "until empty".

Pages and concurrency: after ``abort()`` or a failure a worker thread may still be reading the
request's source pages (or, on the decode side, writing its destination pages).
``quiescent()`` tells whether any backend thread can still touch them; the owner must not
return the pages to the free list before it is True (:class:`kv.release.Releaser` holds them
back until then, for both schedulers).
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Sequence
from typing import Protocol

import attrs


class KVPoll(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        """SUCCESS or FAILED: the states a sender or receiver never leaves."""
        return self in (KVPoll.SUCCESS, KVPoll.FAILED)


class TransferError(Exception):
    """Why a room failed; ``peer`` names the decode (or prefill) endpoint when known."""

    def __init__(self, room: int, reason: str, peer: str = "", *, timeout: bool = False) -> None:
        self.room = room
        self.reason = reason
        self.peer = peer
        self.timeout = timeout
        where = f" (peer {peer})" if peer else ""
        super().__init__(f"room {room}: {reason}{where}")

    @property
    def refused(self) -> bool:
        """The peer refused the room (or failed it before the handshake): see :func:`refusal`."""
        return self.reason.startswith(f"{REASON_PEER_REFUSED}:")

    @classmethod
    def reported(
        cls, room: int, status: KVPoll, reason: str, peer: str = "", *, timeout: bool = False
    ) -> TransferError:
        """What ``failure_exception()`` returns for an end in ``status`` that recorded
        ``reason``: its own failure, or :data:`REASON_OTHER_RANK` when it did not fail itself
        (the FAILED its owner saw came from another rank through the MIN)."""
        if status != KVPoll.FAILED:
            return cls(room, REASON_OTHER_RANK, peer)
        return cls(room, reason, peer, timeout=timeout)


class TransferUsageError(Exception):
    """The caller broke the sender/receiver protocol (a bug in the caller, not a failed
    request); the message names the room and the rule."""

    def __init__(self, room: int, message: str) -> None:
        self.room = room
        super().__init__(f"room {room}: {message}")


# The reason a sender reports when the failure was seen only through another rank's poll.
REASON_OTHER_RANK = "failed on another rank"
# The reason a sender (receiver) reports when its own side aborted the room.
REASON_ABORTED = "aborted"
# The reason a sender reports when the decode side aborted the room; a local-backend receiver
# reports it when the prefill side did (a Mooncake receiver reports the reason prefill sent).
REASON_PEER_ABORTED = "aborted by the peer"
# What the reason of a room starts with when the peer refused it, or failed it before the
# handshake, and said so (see :func:`refusal`).
REASON_PEER_REFUSED = "peer refused"


def refusal(reason: str) -> str:
    """The reason a room fails with when its peer refused it for ``reason``."""
    return f"{REASON_PEER_REFUSED}: {reason}"


def accepts_call(room: int, status: KVPoll, call: str, *, ready: bool = True) -> bool:
    """Whether ``call`` (``init()``, ``send_metadata()``: legal only in WAITING_FOR_INPUT, and
    only when the end is ``ready`` for it) goes ahead. False once the end FAILED: the call is
    ignored, because the caller may not have seen the failure yet. Any other state is misuse:
    :class:`TransferUsageError`."""
    if status == KVPoll.FAILED:
        return False
    if status != KVPoll.WAITING_FOR_INPUT or not ready:
        raise TransferUsageError(room, f"{call} while {status.name}")
    return True


@attrs.define
class SendCursor:
    """The page accounting of one sender: what ``init`` declared and how far ``send`` got.

    Backends share it so that they agree on what is misuse. :meth:`advance` returns the slice
    of the destination page list the chunk maps to.
    """

    room: int
    num_pages: int | None = None
    slot: int | None = None
    sent: int = 0
    finished: bool = False

    def init(self, num_pages: int, slot: int) -> None:
        if self.num_pages is not None:
            raise TransferUsageError(self.room, "init() called twice")
        if num_pages < 0:
            raise TransferUsageError(self.room, f"num_pages must be >= 0, got {num_pages}")
        if slot < 0:
            raise TransferUsageError(self.room, f"slot must be >= 0, got {slot}")
        self.num_pages = num_pages
        self.slot = slot

    def advance(self, num_pages: int, last: bool) -> slice:
        if self.num_pages is None:
            raise TransferUsageError(self.room, "send() before init()")
        if self.finished:
            raise TransferUsageError(self.room, "send() after the last chunk")
        end = self.sent + num_pages
        if end > self.num_pages:
            raise TransferUsageError(
                self.room, f"sending pages {self.sent}..{end - 1} of only {self.num_pages} declared"
            )
        if last and end != self.num_pages:
            raise TransferUsageError(
                self.room, f"last chunk leaves {self.num_pages - end} of {self.num_pages} unsent"
            )
        chunk = slice(self.sent, end)
        self.sent = end
        self.finished = last
        return chunk


class RoomTransfer(Protocol):
    """One end of one room's transfer: what a sender and a receiver have in common."""

    room: int

    def poll(self) -> KVPoll: ...

    def failure_exception(self) -> TransferError: ...

    def abort(self) -> None: ...

    def clear(self) -> None: ...

    def quiescent(self) -> bool: ...


class KVSender(RoomTransfer, Protocol):
    """One per request on the prefill side (the sender protocol above)."""

    def init(self, num_pages: int, slot: int) -> None: ...

    def send(self, pages: Sequence[int], last: bool) -> None: ...

    def abort(self, why: str = "") -> None:
        """Fail the room here and tell the decode peer. ``why`` (a :func:`kv.refusal.peer_refusal`
        text) is for a failure its client is to see as it is: the peer's end fails with
        :func:`refusal` of it rather than as aborted by its peer."""


class KVManager(Protocol):
    """One per prefill rank: creates senders and pushes readiness."""

    ready: queue.SimpleQueue[int]

    def create_sender(self, bootstrap_addr: str, room: int) -> KVSender: ...

    def refuse(self, room: int, reason: str) -> None:
        """This side will not serve ``room`` (it refused the request, or failed it before the
        decode peer's destination came): a destination for it, already here or later, is
        answered with :func:`refusal` of ``reason`` instead of waiting, and a decode receiver
        that waits for pages for it fails with that refusal at once (thread-safe)."""

    def close(self) -> None: ...


class KVReceiver(RoomTransfer, Protocol):
    """One per request on the decode side: BOOTSTRAPPING until ``init()`` resolved the prefill
    peer (it may do so after returning, and pushes the room's readiness then),
    WAITING_FOR_INPUT until ``send_metadata()`` (the request waits for pages: a refusal or a
    failure of the room on the prefill side fails it meanwhile), then TRANSFERRING until the
    KV and the metadata row landed (SUCCESS) or the room failed. ``abort()`` tells the prefill
    peer."""

    def init(self) -> None: ...

    def send_metadata(self, pages: Sequence[int], slot: int) -> None: ...


class ReadyRooms(Protocol):
    """A thread-safe queue of rooms whose receiver may have changed state: the decode peer
    drains it every pass and puts a room back to look at it again on the next."""

    def put(self, room: int, /) -> None: ...

    def get_nowait(self) -> int: ...


class DecodeKVManager(Protocol):
    """One per decode rank (or one router over several): creates receivers and pushes
    readiness of their rooms."""

    @property
    def ready(self) -> ReadyRooms: ...

    def create_receiver(self, bootstrap_addr: str, room: int) -> KVReceiver:
        """The receiver of ``room`` (one live receiver per room: the decode peer clears one
        before it creates another, and a backend may refuse a second with
        :class:`TransferUsageError`)."""

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Tell the prefill peer at ``bootstrap_addr`` that this side will never send a
        destination for ``room`` (refused, or failed before asking), so the peer fails its
        request for the room with :func:`refusal` of ``reason`` now, or when it arrives
        (thread-safe; never blocks on the network)."""

    def close(self) -> None: ...
