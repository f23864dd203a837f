"""The local transfer backend, prefill side: the decode peer lives in the same process.

Theory of operation
-------------------
A :class:`LocalTransferHub` maps bootstrap addresses to prefill managers. A decode receiver
(:mod:`kv.local_decode`) for room R ``init()``s by looking its prefill manager up in the hub
(checking that the two pools have the same page geometry), then ``send_metadata(dst_pages,
dst_slot)`` hands the prefill manager a link: the destination of room R. The prefill
sender for R attaches to the link (at once if it exists, else when it is created) and reports
WAITING_FOR_INPUT.

Room state (:mod:`kv.local_link`): each end of a room reports a :class:`~kv.local_link.Side`;
until the two ends meet each changes only its own, and from then on the
:class:`~kv.local_link.Link` is the one owner of both. Every change happens under the hub's lock
(copies run outside it).

Each ``send(pages, last)`` queues a chunk for the prefill manager's transfer worker thread,
which copies the pages from the prefill pool into the decode pool for all layers and both K
and V (:mod:`kv.local_copy`: one slice copy per run of pages consecutive on both sides and per
region of the pool's layout). The last chunk also copies the metadata row (its room last). When
it lands, the sender and the receiver both conclude SUCCESS. A copy that raises fails the room on
both sides with the error as the reason; the worker carries on.

Aborts: an abort on either side fails that side with ``REASON_ABORTED`` and the other with
``REASON_PEER_ABORTED`` (a receiver that aborts before its sender exists marks the link, and the
sender fails when it attaches). Late messages: a link is closed when its sender is cleared; an
abort from a receiver whose link is closed is dropped, so a reused room is never poisoned.

Refusals (:mod:`kv.refusal`): a link for a room this side refused, or whose sender ended before
the link came, fails with the refusal; a room the decode side refused fails its sender while it
waits for its link, or as it is created.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import attrs

from kv.local_copy import copy_pages
from kv.local_link import Link, Side
from kv.metadata import MetadataBuffers
from kv.pool import KVPool
from kv.refusal import RefusedRooms
from kv.transfer import (
    REASON_PEER_REFUSED,
    KVPoll,
    SendCursor,
    TransferError,
    TransferUsageError,
    accepts_call,
    refusal,
)

logger = logging.getLogger(__name__)


@attrs.frozen
class LocalTransferStats:
    """What the transfer worker moved (KV only; metadata rows are not counted)."""

    chunks: int
    pages: int
    bytes: int
    copy_seconds: float


class LocalTransferHub:
    """Where local decode receivers find prefill managers by bootstrap address."""

    def __init__(self) -> None:
        # One lock for both sides: a link's state is shared by a sender and a receiver.
        self.lock = threading.Lock()
        self._prefill: dict[str, LocalKVManager] = {}

    def register(self, addr: str, manager: LocalKVManager) -> None:
        with self.lock:
            if addr in self._prefill:
                raise ValueError(f"a prefill manager is already registered at {addr!r}")
            self._prefill[addr] = manager

    def unregister(self, addr: str) -> None:
        with self.lock:
            self._prefill.pop(addr, None)

    def lookup(self, addr: str) -> LocalKVManager | None:
        """The prefill manager at ``addr``; the caller holds :attr:`lock`."""
        return self._prefill.get(addr)


@attrs.frozen
class _Chunk:
    link: Link
    src_pages: list[int]
    dst_pages: list[int]
    last: bool
    src_slot: int


def check_pages(room: int, pages: list[int], pool: KVPool, side: str) -> None:
    if pages and (min(pages) < 0 or max(pages) >= pool.num_pages):
        bad = next(p for p in pages if not 0 <= p < pool.num_pages)
        raise TransferUsageError(
            room, f"page {bad} is not in the {side} pool (0..{pool.num_pages - 1})"
        )


def check_slot(room: int, slot: int, metadata: MetadataBuffers, side: str) -> None:
    if not 0 <= slot < metadata.num_slots:
        raise TransferUsageError(
            room,
            f"slot {slot} is not in the {side} metadata buffers (0..{metadata.num_slots - 1})",
        )


class LocalKVManager:
    """Prefill side: senders, and the worker thread that copies their chunks."""

    def __init__(
        self,
        pool: KVPool,
        metadata: MetadataBuffers,
        *,
        hub: LocalTransferHub,
        bootstrap_addr: str = "local",
    ) -> None:
        self.pool = pool
        self.metadata = metadata
        self.bootstrap_addr = bootstrap_addr
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._hub = hub
        self._lock = hub.lock
        self._senders: dict[int, LocalKVSender] = {}
        self._pending: dict[int, Link] = {}
        self._refused = RefusedRooms()  # rooms this side will not serve
        self._peer_refused = RefusedRooms()  # rooms the decode side will not ask for
        self._chunks: queue.SimpleQueue[_Chunk | None] = queue.SimpleQueue()
        self._stats = LocalTransferStats(0, 0, 0, 0.0)
        self._closed = False
        hub.register(bootstrap_addr, self)
        self._worker = threading.Thread(
            target=self._work, name=f"kv-local-transfer[{bootstrap_addr}]", daemon=True
        )
        self._worker.start()

    def create_sender(self, bootstrap_addr: str, room: int) -> LocalKVSender:
        with self._lock:
            if self._closed:
                raise TransferUsageError(room, "create_sender() on a closed manager")
            if room in self._senders:
                raise TransferUsageError(room, "the room already has a live sender; clear() it")
            sender = LocalKVSender(self, bootstrap_addr, room)
            self._senders[room] = sender
            refused = self._peer_refused.pop(room)
            link = self._pending.pop(room, None)
            if refused is not None:
                sender._side.fail(refusal(refused))
            elif link is not None:
                sender._attach(link)
            return sender

    def refuse(self, room: int, reason: str) -> None:
        """This side will not serve ``room``: its links, waiting or to come, fail (any thread)."""
        with self._lock:
            self._refused.add(room, reason)
            link = self._pending.pop(room, None)
            if link is not None:
                link.decode.fail(refusal(reason))

    def peer_refused(self, room: int, reason: str) -> None:
        """The decode side will never send ``room``'s destination: its sender fails now if it
        waits for one, or when it is created (the caller holds the hub's lock)."""
        sender = self._senders.get(room)
        if sender is None:
            self._peer_refused.add(room, reason)
        elif sender._link is None:
            sender._side.fail(refusal(reason))

    def stats(self) -> LocalTransferStats:
        with self._lock:
            return self._stats

    def close(self) -> None:
        """Finish the queued chunks, stop the worker and leave the hub."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._chunks.put(None)
        self._worker.join()
        self._hub.unregister(self.bootstrap_addr)

    def deliver(self, link: Link) -> None:
        """A receiver's destination arrived (the caller holds the hub's lock): the room's
        sender attaches, or the link waits for it; a link already waiting is superseded."""
        room = link.decode.room
        sender = self._senders.get(room)
        if sender is not None and sender._attach(link):
            return
        refused = self._refused.get(room)
        if sender is not None and sender._link is None and sender._side.status == KVPoll.FAILED:
            refused = sender._side.reason  # failed before its link came
        if refused is not None:
            link.decode.fail(refusal(refused))
            return
        superseded = self._pending.get(room)
        if superseded is not None:
            superseded.decode.fail(f"superseded by another receiver for room {room}")
        self._pending[room] = link

    # -- the worker thread ----------------------------------------------------------------

    def _work(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            try:
                self._run(chunk)
            except Exception:
                # _run handles copy errors itself; this is a bookkeeping bug. Keep serving.
                logger.exception("transfer worker: chunk of room %d", chunk.link.decode.room)

    def _run(self, chunk: _Chunk) -> None:
        link = chunk.link
        with self._lock:
            wanted = link.copying()
        error = ""
        started = time.perf_counter()
        if wanted:
            try:
                copy_pages(self.pool, link.dst_pool, chunk.src_pages, chunk.dst_pages)
                if chunk.last:
                    link.dst_metadata.copy_row_from(self.metadata, chunk.src_slot, link.dst_slot)
            except Exception as exc:
                logger.exception("transfer worker: copying room %d failed", link.decode.room)
                error = f"local copy failed: {exc!r}"
        elapsed = time.perf_counter() - started
        with self._lock:
            if wanted and not error:
                s = self._stats
                n = len(chunk.src_pages)
                self._stats = LocalTransferStats(
                    chunks=s.chunks + 1,
                    pages=s.pages + n,
                    bytes=s.bytes + self.pool.bytes_of_pages(n),
                    copy_seconds=s.copy_seconds + elapsed,
                )
            link.chunk_done(copied=wanted, last=chunk.last, error=error)


class LocalEndpoint:
    """What a sender and a receiver share: one end of a room, its side and (once the ends
    met) its link, guarded by the hub's lock."""

    def __init__(self, lock: threading.Lock, bootstrap_addr: str, side: Side) -> None:
        self.room = side.room
        self.bootstrap_addr = bootstrap_addr
        self._lock = lock
        self._side = side
        self._link: Link | None = None

    def poll(self) -> KVPoll:
        with self._lock:
            return self._side.status

    def failure_exception(self) -> TransferError:
        with self._lock:
            side = self._side
            return TransferError.reported(self.room, side.status, side.reason, self.bootstrap_addr)

    def quiescent(self) -> bool:
        with self._lock:
            return self._link is None or self._link.inflight == 0

    def abort(self) -> None:
        """Fail the room here and tell the other end, unless the sender was cleared."""
        with self._lock:
            self._abort_locked()

    def clear(self) -> None:
        with self._lock:
            self._abort_locked()
            self._forget()

    # -- called with the lock held --------------------------------------------------------

    def _abort_locked(self) -> None:
        if self._link is None:
            self._side.abort()
        else:
            self._link.abort(self._side)

    def _forget(self) -> None:
        raise NotImplementedError


class LocalKVSender(LocalEndpoint):
    def __init__(self, manager: LocalKVManager, bootstrap_addr: str, room: int) -> None:
        super().__init__(manager._lock, bootstrap_addr, Side(room, manager.ready, "sender"))
        self._manager = manager
        self._cursor = SendCursor(room)

    @property
    def sent_pages(self) -> int:
        return self._cursor.sent

    def init(self, num_pages: int, slot: int) -> None:
        with self._lock:
            link = self._link
            if not accepts_call(self.room, self._side.status, "init()", ready=link is not None):
                return
            assert link is not None
            check_slot(self.room, slot, self._manager.metadata, "prefill")
            self._cursor.init(num_pages, slot)
            have = len(link.dst_pages)
            if num_pages > have:
                link.fail(
                    f"the decode peer gave {have} destination pages, {num_pages} are needed"
                )

    def send(self, pages: Sequence[int], last: bool) -> None:
        src = [int(p) for p in pages]
        manager = self._manager
        with self._lock:
            if self._side.status == KVPoll.FAILED:
                return
            if self._cursor.num_pages is None or self._link is None:
                raise TransferUsageError(
                    self.room, f"send() before init() while {self._side.status.name}"
                )
            if manager._closed:
                raise TransferUsageError(self.room, "send() on a closed manager")
            check_pages(self.room, src, manager.pool, "prefill")
            span = self._cursor.advance(len(src), last)
            assert self._cursor.slot is not None
            link = self._link
            link.queue_chunk()
            manager._chunks.put(_Chunk(link, src, link.dst_pages[span], last, self._cursor.slot))

    # -- called with the lock held --------------------------------------------------------

    def _attach(self, link: Link) -> bool:
        """Attach to ``link`` if this sender still waits for one."""
        if self._link is not None or self._side.status != KVPoll.BOOTSTRAPPING:
            return False
        self._link = link
        link.attach(self._side)
        return True

    def _forget(self) -> None:
        manager = self._manager
        if manager._senders.get(self.room) is self:
            del manager._senders[self.room]
        if self._link is not None:
            self._link.closed = True
        elif not self._side.reason.startswith(REASON_PEER_REFUSED):
            # Ended before the receiver's destination came: a late one gets the refusal.
            manager._refused.add(self.room, self._side.reason)
