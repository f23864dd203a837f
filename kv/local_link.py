"""The local backend's room state: each end's :class:`Side`, and the :class:`Link` that owns
both once the ends met.

Until a receiver sends its destination, each end of a room changes only its own side (the
receiver finds its prefill manager, the sender waits for the destination, either may abort).
From ``send_metadata()`` on, the room is a :class:`Link`, and every change that concerns it
goes through the link's methods, which move both sides together: the sender attaching, a chunk
queued or copied, a failure, an abort from either end. All of it happens under the hub's lock
(:class:`kv.local.LocalTransferHub`); every change is announced on the ``ready`` queue of each
side whose state changed, and a failed room is announced again when it becomes quiescent.
"""

from __future__ import annotations

import logging
import queue

import attrs

from kv.metadata import MetadataBuffers
from kv.pool import KVPool
from kv.transfer import REASON_ABORTED, REASON_PEER_ABORTED, KVPoll

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class Side:
    """What one end of a room reports: its status and why it failed. Changed only under the
    hub's lock; every change is announced on the end's ``ready`` queue (unless ``muted``: a
    cleared receiver is no one's news)."""

    room: int
    ready: queue.SimpleQueue[int] = attrs.field(repr=False)
    end: str  # "sender" or "receiver", for logs
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

    def abort(self) -> None:
        """The end aborted before the ends met."""
        self.fail(REASON_ABORTED)

    def announce(self) -> None:
        if not self.muted:
            self.ready.put(self.room)


@attrs.define(eq=False)
class Link:
    """Room R from the moment its receiver sent the destination: where its pages go, and the
    one owner of both sides' state (the receiver's, and the sender's once it attached)."""

    decode: Side
    dst_pool: KVPool
    dst_metadata: MetadataBuffers
    dst_pages: list[int]
    dst_slot: int
    prefill: Side | None = None
    closed: bool = False  # the sender was cleared: aborts from decode are late, and dropped
    aborted_by_decode: bool = False  # before a sender attached
    inflight: int = 0  # chunks queued or being copied

    def attach(self, prefill: Side) -> None:
        self.prefill = prefill
        if self.aborted_by_decode:
            prefill.fail(REASON_PEER_ABORTED)
        else:
            prefill.set(KVPoll.WAITING_FOR_INPUT)

    def fail(self, reason: str) -> None:
        """Both sides fail (a copy that raised, too few destination pages)."""
        if self.prefill is not None:
            self.prefill.fail(reason)
        self.decode.fail(reason)

    def abort(self, by: Side) -> None:
        """The end ``by`` aborted: it fails as aborted and the other end as aborted by its
        peer (a sender that attaches later, when it does); nothing once ``by`` concluded, and
        nothing to the receiver once the sender was cleared (the abort is late)."""
        if by.status.terminal:
            return
        by.fail(REASON_ABORTED)
        if self.closed:
            return
        other = self.prefill if by is self.decode else self.decode
        if other is None:
            self.aborted_by_decode = True
        else:
            other.fail(REASON_PEER_ABORTED)

    def queue_chunk(self) -> None:
        assert self.prefill is not None
        self.inflight += 1
        self.prefill.status = KVPoll.TRANSFERRING

    def copying(self) -> bool:
        """Whether a queued chunk is still wanted: the transfer is on and the sender live."""
        return (self.prefill is not None and self.prefill.status == KVPoll.TRANSFERRING
                and not self.closed)

    def chunk_done(self, *, copied: bool, last: bool, error: str) -> None:
        assert self.prefill is not None
        self.inflight -= 1
        if error:
            self.fail(error)
        elif copied and last and self.prefill.status == KVPoll.TRANSFERRING:
            self.prefill.set(KVPoll.SUCCESS)
            self.decode.set(KVPoll.SUCCESS)
        elif self.inflight == 0 and KVPoll.FAILED in (self.prefill.status, self.decode.status):
            # A failed room became quiescent: its owners may now free the pages.
            self.prefill.announce()
            self.decode.announce()
