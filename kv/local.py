"""The local transfer backend: the decode peer lives in the same process.

Theory of operation
-------------------
A :class:`LocalTransferHub` maps bootstrap addresses to prefill managers. A decode receiver
for room R ``init()``s by looking its prefill manager up in the hub (checking that the two
pools have the same page geometry), then ``send_metadata(dst_pages, dst_slot)`` hands the
prefill manager a *link*: the destination of room R. The prefill sender for R attaches to the
link (at once if it exists, else when it is created) and reports WAITING_FOR_INPUT.

Each ``send(pages, last)`` queues a chunk for the prefill manager's transfer worker thread,
which copies the pages from the prefill pool into the decode pool for all layers and both K
and V: page lists are coalesced into runs consecutive on both sides and each run moves as one
slice copy of a ``[layers * 2, pages, page_elems]`` view (between CPU pools a small run goes
through numpy byte views, a large one through torch's multi-threaded copy); between device pools
badly scattered lists move with one ``index_select`` / ``index_copy_`` instead. The last chunk
also copies the metadata row (its room last). When it lands, the sender and the receiver both
conclude SUCCESS. A copy that raises fails the room on both sides with the error as the reason;
the worker carries on.

Aborts: an abort on either side fails that side with ``REASON_ABORTED`` and the other with
``REASON_PEER_ABORTED`` (a receiver that aborts before its sender exists marks the link, and the
sender fails when it attaches). Late messages: a link is closed when its sender is cleared; an
abort from a receiver whose link is closed is dropped, so a reused room is never poisoned.
Every state change is guarded by the hub's lock (copies run outside it) and pushes the room
onto the ``ready`` queue of each side whose state changed, including when a failed room becomes
quiescent.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import attrs
import torch

from kv.metadata import MetadataBuffers
from kv.pages import coalesce
from kv.pool import KVGeometryError, KVPool
from kv.transfer import (
    REASON_ABORTED,
    REASON_OTHER_RANK,
    REASON_PEER_ABORTED,
    TERMINAL,
    KVPoll,
    SendCursor,
    TransferError,
    TransferUsageError,
)

logger = logging.getLogger(__name__)

# On an accelerator, above this many runs one gather/scatter over the page dimension beats a
# launch per run.
_MAX_SLICE_RUNS = 16
_PARALLEL_COPY_BYTES = 1 << 20  # a run at least this large is copied by torch


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


@attrs.define(eq=False)
class _Link:
    """Room R's destination, from one receiver to (at most) one sender."""

    receiver: LocalKVReceiver
    dst_pages: list[int]
    dst_slot: int
    sender: LocalKVSender | None = None
    closed: bool = False
    aborted_by_decode: bool = False
    inflight: int = 0


@attrs.frozen
class _Chunk:
    sender: LocalKVSender
    link: _Link
    src_pages: list[int]
    dst_pages: list[int]
    last: bool
    src_slot: int


def _copy_pages(src: KVPool, dst: KVPool, src_pages: list[int], dst_pages: list[int]) -> None:
    src_view, dst_view = src.page_view(), dst.page_view()
    runs = coalesce(src_pages, dst_pages)
    if src_view.device.type == "cpu" and dst_view.device.type == "cpu":
        # A large run goes through torch's copy, which spreads it over the intra-op threads.
        # A small one goes through numpy's single memcpy: torch opens a parallel region per
        # call, and on a busy host with few cores each region can stall on a descheduled
        # thread, which dominates when a chunk has many small runs.
        src_bytes = src_view.view(torch.uint8).numpy()
        dst_bytes = dst_view.view(torch.uint8).numpy()
        row_bytes = src_bytes.shape[0] * src_bytes.shape[2]
        for r in runs:
            if r.length * row_bytes >= _PARALLEL_COPY_BYTES:
                dst_view[:, r.dst_start : r.dst_start + r.length].copy_(
                    src_view[:, r.src_start : r.src_start + r.length]
                )
            else:
                dst_bytes[:, r.dst_start : r.dst_start + r.length] = src_bytes[
                    :, r.src_start : r.src_start + r.length
                ]
        return
    if len(runs) <= _MAX_SLICE_RUNS:
        for r in runs:
            dst_view[:, r.dst_start : r.dst_start + r.length].copy_(
                src_view[:, r.src_start : r.src_start + r.length]
            )
        return
    src_idx = torch.tensor(src_pages, dtype=torch.long, device=src_view.device)
    dst_idx = torch.tensor(dst_pages, dtype=torch.long, device=dst_view.device)
    gathered = src_view.index_select(1, src_idx).to(dst_view.device)
    dst_view.index_copy_(1, dst_idx, gathered)


def _check_pages(room: int, pages: list[int], pool: KVPool, side: str) -> None:
    if pages and (min(pages) < 0 or max(pages) >= pool.num_pages):
        bad = next(p for p in pages if not 0 <= p < pool.num_pages)
        raise TransferUsageError(
            room, f"page {bad} is not in the {side} pool (0..{pool.num_pages - 1})"
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
        self._pending: dict[int, _Link] = {}
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
            link = self._pending.pop(room, None)
            if link is not None:
                self._attach(sender, link)
            return sender

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

    # -- called with the lock held --------------------------------------------------------

    def _deliver(self, link: _Link) -> None:
        room = link.receiver.room
        sender = self._senders.get(room)
        if sender is not None and sender._link is None and sender._status == KVPoll.BOOTSTRAPPING:
            self._attach(sender, link)
            return
        superseded = self._pending.get(room)
        if superseded is not None:
            superseded.receiver._fail(f"superseded by another receiver for room {room}")
        self._pending[room] = link

    def _attach(self, sender: LocalKVSender, link: _Link) -> None:
        link.sender = sender
        sender._link = link
        if link.aborted_by_decode:
            sender._fail(REASON_PEER_ABORTED)
        else:
            sender._set(KVPoll.WAITING_FOR_INPUT)

    # -- the worker thread ----------------------------------------------------------------

    def _work(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            try:
                self._run(chunk)
            except Exception:
                # _run handles copy errors itself; this is a bookkeeping bug. Keep serving.
                logger.exception("transfer worker: chunk of room %d", chunk.sender.room)

    def _run(self, chunk: _Chunk) -> None:
        sender, link = chunk.sender, chunk.link
        with self._lock:
            live = sender._status == KVPoll.TRANSFERRING and not link.closed
        error = ""
        started = time.perf_counter()
        if live:
            try:
                decode = link.receiver._manager
                _copy_pages(self.pool, decode.pool, chunk.src_pages, chunk.dst_pages)
                if chunk.last:
                    decode.metadata.copy_row_from(self.metadata, chunk.src_slot, link.dst_slot)
            except Exception as exc:
                logger.exception("transfer worker: copying room %d failed", sender.room)
                error = f"local copy failed: {exc!r}"
        elapsed = time.perf_counter() - started
        with self._lock:
            link.inflight -= 1
            if live and not error:
                s = self._stats
                n = len(chunk.src_pages)
                self._stats = LocalTransferStats(
                    chunks=s.chunks + 1,
                    pages=s.pages + n,
                    bytes=s.bytes + n * self.pool.page_bytes * self.pool.num_layers * 2,
                    copy_seconds=s.copy_seconds + elapsed,
                )
            if error:
                sender._fail(error)
                link.receiver._fail(error)
            elif live and chunk.last and sender._status == KVPoll.TRANSFERRING:
                sender._set(KVPoll.SUCCESS)
                link.receiver._set(KVPoll.SUCCESS)
            elif link.inflight == 0 and KVPoll.FAILED in (sender._status, link.receiver._status):
                # A failed room became quiescent: its owners may now free the pages.
                sender._announce()
                link.receiver._announce()


class _Endpoint:
    """What a sender and a receiver share: one side of a room, its status and failure reason
    guarded by the hub's lock, and its link to the other side."""

    _side = ""  # for logs

    def __init__(self, lock: threading.Lock, bootstrap_addr: str, room: int) -> None:
        self.room = room
        self.bootstrap_addr = bootstrap_addr
        self._lock = lock
        self._status = KVPoll.BOOTSTRAPPING
        self._reason = ""
        self._link: _Link | None = None

    def poll(self) -> KVPoll:
        with self._lock:
            return self._status

    def failure_exception(self) -> TransferError:
        with self._lock:
            reason = self._reason if self._status == KVPoll.FAILED else REASON_OTHER_RANK
        return TransferError(self.room, reason, self.bootstrap_addr)

    def quiescent(self) -> bool:
        with self._lock:
            return self._link is None or self._link.inflight == 0

    # -- called with the lock held --------------------------------------------------------

    def _announce(self) -> None:
        raise NotImplementedError

    def _set(self, status: KVPoll) -> None:
        self._status = status
        self._announce()

    def _fail(self, reason: str) -> None:
        if self._status in TERMINAL:
            return
        self._reason = reason
        logger.debug("local %s room %d failed: %s", self._side, self.room, reason)
        self._set(KVPoll.FAILED)


class LocalKVSender(_Endpoint):
    _side = "sender"

    def __init__(self, manager: LocalKVManager, bootstrap_addr: str, room: int) -> None:
        super().__init__(manager._lock, bootstrap_addr, room)
        self._manager = manager
        self._cursor = SendCursor(room)

    @property
    def sent_pages(self) -> int:
        return self._cursor.sent

    def init(self, num_pages: int, slot: int) -> None:
        with self._manager._lock:
            if self._status == KVPoll.FAILED:
                return
            if self._status != KVPoll.WAITING_FOR_INPUT or self._link is None:
                raise TransferUsageError(self.room, f"init() while {self._status.name}")
            if not 0 <= slot < self._manager.metadata.num_slots:
                raise TransferUsageError(
                    self.room,
                    f"slot {slot} is not in the metadata buffers "
                    f"(0..{self._manager.metadata.num_slots - 1})",
                )
            self._cursor.init(num_pages, slot)
            have = len(self._link.dst_pages)
            if num_pages > have:
                reason = f"the decode peer gave {have} destination pages, {num_pages} are needed"
                self._fail(reason)
                self._link.receiver._fail(reason)

    def send(self, pages: Sequence[int], last: bool) -> None:
        src = [int(p) for p in pages]
        manager = self._manager
        with manager._lock:
            if self._status == KVPoll.FAILED:
                return
            if self._cursor.num_pages is None or self._link is None:
                raise TransferUsageError(
                    self.room, f"send() before init() while {self._status.name}"
                )
            if manager._closed:
                raise TransferUsageError(self.room, "send() on a closed manager")
            _check_pages(self.room, src, manager.pool, "prefill")
            span = self._cursor.advance(len(src), last)
            assert self._cursor.slot is not None
            link = self._link
            link.inflight += 1
            self._status = KVPoll.TRANSFERRING
            manager._chunks.put(
                _Chunk(self, link, src, link.dst_pages[span], last, self._cursor.slot)
            )

    def abort(self) -> None:
        with self._manager._lock:
            self._abort_locked()

    def clear(self) -> None:
        with self._manager._lock:
            self._abort_locked()
            if self._manager._senders.get(self.room) is self:
                del self._manager._senders[self.room]
            if self._link is not None:
                self._link.closed = True

    # -- called with the lock held --------------------------------------------------------

    def _abort_locked(self) -> None:
        if self._status in TERMINAL:
            return
        self._fail(REASON_ABORTED)
        if self._link is not None and not self._link.closed:
            self._link.receiver._fail(REASON_PEER_ABORTED)

    def _announce(self) -> None:
        self._manager.ready.put(self.room)


class LocalDecodeManager:
    """Decode side: receivers whose pages and metadata rows the prefill worker fills."""

    def __init__(self, pool: KVPool, metadata: MetadataBuffers, *, hub: LocalTransferHub) -> None:
        self.pool = pool
        self.metadata = metadata
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._hub = hub
        self._lock = hub.lock

    def create_receiver(self, bootstrap_addr: str, room: int) -> LocalKVReceiver:
        return LocalKVReceiver(self, bootstrap_addr, room)

    def close(self) -> None:
        """Nothing to release: the copies run on the prefill manager's worker."""


class LocalKVReceiver(_Endpoint):
    _side = "receiver"

    def __init__(self, manager: LocalDecodeManager, bootstrap_addr: str, room: int) -> None:
        super().__init__(manager._lock, bootstrap_addr, room)
        self._manager = manager
        self._prefill: LocalKVManager | None = None
        self._cleared = False

    def init(self) -> None:
        """Resolve the prefill peer. Raises :class:`KVGeometryError` when its pool's page
        layout differs from ours (a deployment error: no request could ever transfer)."""
        manager = self._manager
        with manager._lock:
            if self._status != KVPoll.BOOTSTRAPPING:
                return
            prefill = manager._hub.lookup(self.bootstrap_addr)
            if prefill is None:
                self._fail(f"no prefill server at {self.bootstrap_addr!r}")
                return
            mismatches = prefill.pool.geometry.mismatches(manager.pool.geometry)
            if mismatches:
                raise KVGeometryError(
                    f"room {self.room}: the prefill pool at {self.bootstrap_addr!r} and this "
                    f"decode pool differ in {'; '.join(mismatches)} (prefill vs decode); "
                    "configure both sides with the same model and page layout"
                )
            self._prefill = prefill
            self._set(KVPoll.WAITING_FOR_INPUT)

    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        dst = [int(p) for p in pages]
        manager = self._manager
        with manager._lock:
            if self._status == KVPoll.FAILED:
                return
            if self._status != KVPoll.WAITING_FOR_INPUT or self._prefill is None:
                raise TransferUsageError(self.room, f"send_metadata() while {self._status.name}")
            _check_pages(self.room, dst, manager.pool, "decode")
            if not 0 <= slot < manager.metadata.num_slots:
                raise TransferUsageError(
                    self.room,
                    f"slot {slot} is not in the decode metadata buffers "
                    f"(0..{manager.metadata.num_slots - 1})",
                )
            self._link = _Link(receiver=self, dst_pages=dst, dst_slot=slot)
            self._set(KVPoll.TRANSFERRING)
            self._prefill._deliver(self._link)

    def abort(self) -> None:
        """Fail the room here and tell the prefill peer, unless its sender was cleared."""
        with self._manager._lock:
            self._abort_locked()

    def clear(self) -> None:
        with self._manager._lock:
            self._abort_locked()
            self._cleared = True

    # -- called with the lock held --------------------------------------------------------

    def _abort_locked(self) -> None:
        if self._status not in TERMINAL:
            self._fail(REASON_ABORTED)
        link = self._link
        if link is None or link.closed:
            return
        if link.sender is None:
            link.aborted_by_decode = True
        else:
            link.sender._fail(REASON_PEER_ABORTED)

    def _announce(self) -> None:
        if not self._cleared:
            self._manager.ready.put(self.room)
