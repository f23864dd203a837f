"""The local transfer backend, prefill side: the decode peer lives in the same process.

Theory of operation
-------------------
A :class:`~kv.local_hub.LocalTransferHub` maps bootstrap addresses to prefill servers, each one
or more :class:`LocalKVManager` ranks (a TP x PP x DP mesh, :class:`~kv.rank_table.RankPlace`).
A decode receiver (:mod:`kv.local_decode`) for room R ``init()``s by looking the server up
(checking that the pools agree on everything but the heads and layers their places give them),
and computes which ranks it contacts and which must write before its room is complete
(:func:`kv.routes.route_places`); ``send_metadata(dst_pages, dst_slot)`` hands its destination
to the room's group. A sender for R joins the same group when it is created, and leaves
BOOTSTRAPPING once it holds the destinations of every decode rank it owes
(:mod:`kv.local_room`, the one owner of every end's state, under the hub's lock; copies run
outside it).

Each ``send(pages, last)`` queues a chunk for the rank's transfer worker thread, which copies
the pages into every destination's pool (:mod:`kv.local_copy`): whole pages of every layer when
the rank's pages are whole decode pages, else the rank's head slices of its stage's layers into
the same layers of the decode pool. The last chunk of the source chosen to write it also copies
the metadata row (its room last). With state pools each destination also gets this rank's
shares of them (:func:`kv.state_routes.state_duty`; :func:`kv.state_copy.move_state`). A
status-only rank (it writes no pages and no state to anyone) concludes at its last ``send``
without copying. A copy that raises fails the room everywhere, with the error as
the reason; the worker carries on.

Aborts: an abort on any end fails every end of the room: ``aborted`` where it happened,
``aborted by the peer`` on the other side, ``failed on another rank`` on its own side's other
ranks. Late messages: a cleared sender retires its group, so an abort from an old receiver
reaches only the old room.

Refusals (:mod:`kv.refusal`): a destination for a room this rank refused, or whose sender ended
before any destination came, fails with the refusal; a room the decode side refused fails its
sender while it waits for its destinations, or as it is created.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence

import attrs

from kv.local_copy import copy_to_rank
from kv.local_hub import LocalServer, LocalTransferHub
from kv.local_room import DECODE, PREFILL, End, Failure, RoomGroup, SenderEnd, Side
from kv.metadata import MetadataBuffers
from kv.pool import KVPool
from kv.rank_table import RankPlace
from kv.refusal import RefusedRooms
from kv.state_copy import check_state, move_state, owed_state
from kv.state_pools import StateKind, StatePools
from kv.transfer import (
    REASON_ABORTED,
    REASON_OTHER_RANK,
    REASON_PEER_ABORTED,
    KVPoll,
    SendCursor,
    TransferError,
    TransferUsageError,
    accepts_call,
    refusal,
)

__all__ = ["LocalKVManager", "LocalKVSender", "LocalTransferHub", "LocalTransferStats"]

logger = logging.getLogger(__name__)


@attrs.frozen
class LocalTransferStats:
    """What the transfer worker moved (KV only; metadata rows are not counted)."""

    chunks: int
    pages: int
    bytes: int
    copy_seconds: float


@attrs.frozen
class _Chunk:
    sender: LocalKVSender
    src_pages: list[int]
    dst_pages: dict[int, list[int]]  # decode TP rank -> its pages for this chunk
    last: bool
    src_slot: int
    state: Mapping[StateKind, list[int]]  # the last chunk's state_indices


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
    """One prefill rank: senders, and the worker thread that copies their chunks."""

    def __init__(
        self,
        pool: KVPool,
        metadata: MetadataBuffers,
        *,
        hub: LocalTransferHub,
        bootstrap_addr: str = "local",
        place: RankPlace | None = None,
        states: StatePools | None = None,
    ) -> None:
        self.pool = pool
        self.states = states  # a hybrid model's state pools, moved with the pages
        self.carries_state = states is not None  # senders move state (``send_state``)
        self.metadata = metadata
        self.bootstrap_addr = bootstrap_addr
        self._place = place or RankPlace.single(num_layers=pool.num_layers,
                                                kv_heads=pool.kv_heads)
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._hub = hub
        self._lock = hub.lock
        self._senders: dict[int, LocalKVSender] = {}
        self.refused = RefusedRooms()  # rooms this side will not serve
        self.peer_refused_rooms = RefusedRooms()  # rooms the decode side will not ask for
        self._chunks: queue.SimpleQueue[_Chunk | None] = queue.SimpleQueue()
        self._stats = LocalTransferStats(0, 0, 0, 0.0)
        self._closed = False
        hub.register(bootstrap_addr, self)
        name = bootstrap_addr if self._place.world_size == 1 else (
            f"{bootstrap_addr} rank {self.rank}")
        self._worker = threading.Thread(
            target=self._work, name=f"kv-local-transfer[{name}]", daemon=True
        )
        self._worker.start()

    @property
    def place(self) -> RankPlace:
        return self._place

    @property
    def rank(self) -> int:
        return self._place.rank

    def _server(self) -> LocalServer:
        """This rank's server (the caller holds the hub's lock; the manager is not closed)."""
        server = self._hub.lookup(self.bootstrap_addr)
        assert server is not None, "a live manager is registered"
        return server

    def create_sender(self, bootstrap_addr: str, room: int) -> LocalKVSender:
        with self._lock:
            if self._closed:
                raise TransferUsageError(room, "create_sender() on a closed manager")
            if room in self._senders:
                raise TransferUsageError(room, "the room already has a live sender; clear() it")
            sender = LocalKVSender(self, bootstrap_addr, room)
            self._senders[room] = sender
            sender._group = self._server().join_sender(self, sender._end)
            return sender

    def live_rooms(self) -> int:
        """Senders not cleared yet (a leak check)."""
        with self._lock:
            return len(self._senders)

    def refuse(self, room: int, reason: str) -> None:
        """This side will not serve ``room``: destinations for it, waiting or to come, fail,
        and so do receivers waiting for pages for it (any thread); a room this rank already
        serves keeps its own."""
        with self._lock:
            self.refused.add(room, reason)
            server = self._hub.lookup(self.bootstrap_addr)
            group = None if server is None else server.groups.get(room)
            if group is not None and self.rank not in group.senders and group.contacted(
                    self.rank):
                group.fail(Failure.everywhere(PREFILL, refusal(reason)))

    def peer_refused(self, room: int, reason: str) -> None:
        """The decode side will never send ``room``'s destination: its sender fails now if it
        waits for one, or when it is created (the caller holds the hub's lock)."""
        sender = self._senders.get(room)
        if sender is None:
            self.peer_refused_rooms.add(room, reason)
        elif not sender._end.dests and sender._group is not None:
            sender._group.fail(Failure.everywhere(DECODE, refusal(reason)))

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
        self._hub.unregister(self.bootstrap_addr, self)

    # -- the worker thread ----------------------------------------------------------------

    def _work(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            try:
                self._run(chunk)
            except Exception:
                # _run handles copy errors itself; this is a bookkeeping bug. Keep serving.
                logger.exception("transfer worker: chunk of room %d", chunk.sender.room)

    def _run(self, chunk: _Chunk) -> None:
        sender = chunk.sender
        end = sender._end
        with self._lock:
            wanted = RoomGroup.copying(end, sender._cleared)
            duty = end.duty
            dests = dict(end.dests)
        error = ""
        moved = 0
        started = time.perf_counter()
        if wanted:
            assert duty is not None
            try:
                for d, receiver in dests.items():
                    slices = duty.slices(d)
                    moved += copy_to_rank(self.pool, receiver.pool, chunk.src_pages,
                                          chunk.dst_pages[d], slices, duty.layers,
                                          whole=duty.whole_pages(d))
                    moved += move_state(
                        self.states, receiver.states, owed_state(self.states, duty).shares(d),
                        src_pages=chunk.src_pages, dst_pages=chunk.dst_pages[d],
                        last=chunk.last, src_state=chunk.state, dst_state=receiver.state)
                    if chunk.last and receiver.row_writer == self.rank:
                        receiver.metadata.copy_row_from(self.metadata, chunk.src_slot,
                                                        receiver.slot)
            except Exception as exc:
                logger.exception("transfer worker: copying room %d failed", sender.room)
                error = f"local copy failed: {exc!r}"
        elapsed = time.perf_counter() - started
        with self._lock:
            if wanted and not error:
                s = self._stats
                self._stats = LocalTransferStats(
                    chunks=s.chunks + 1,
                    pages=s.pages + len(chunk.src_pages),
                    bytes=s.bytes + moved,
                    copy_seconds=s.copy_seconds + elapsed,
                )
            assert sender._group is not None
            sender._group.chunk_done(end, copied=wanted, last=chunk.last, error=error)


class LocalEndpoint:
    """What a sender and a receiver share: one end of a room and (once it joined) its group,
    guarded by the hub's lock."""

    def __init__(self, lock: threading.Lock, bootstrap_addr: str, side: Side) -> None:
        self.room = side.room
        self.bootstrap_addr = bootstrap_addr
        self._lock = lock
        self._side = side
        self._group: RoomGroup | None = None

    def poll(self) -> KVPoll:
        with self._lock:
            return self._side.status

    def failure_exception(self) -> TransferError:
        with self._lock:
            side = self._side
            return TransferError.reported(self.room, side.status, side.reason, self.bootstrap_addr)

    def quiescent(self) -> bool:
        with self._lock:
            end = self._joined()
            return end is None or end.inflight == 0

    def abort(self, why: str = "") -> None:
        """Fail the room here and on every other end of it (``why``: see
        :meth:`kv.transfer.KVSender.abort`)."""
        with self._lock:
            self._abort_locked(why)

    def clear(self) -> None:
        with self._lock:
            self._abort_locked()
            self._forget()

    # -- called with the lock held --------------------------------------------------------

    def _joined(self) -> End | None:
        """This end as its group holds it, once it joined one."""
        raise NotImplementedError

    def _abort_locked(self, why: str = "") -> None:
        end = self._joined()
        if end is None or self._group is None:
            self._side.fail(REASON_ABORTED)
            return
        group = self._group
        if why:
            if isinstance(end, SenderEnd) and not end.side.status.terminal:
                end.told = why
            peer = refusal(why)
        elif group.receivers or end.side.end != PREFILL:
            peer = REASON_PEER_ABORTED
        else:
            peer = refusal(REASON_ABORTED)
        group.abort(end, peer, REASON_ABORTED, REASON_OTHER_RANK)

    def _forget(self) -> None:
        raise NotImplementedError


class LocalKVSender(LocalEndpoint):
    def __init__(self, manager: LocalKVManager, bootstrap_addr: str, room: int) -> None:
        super().__init__(manager._lock, bootstrap_addr, Side(room, manager.ready, PREFILL))
        self._manager = manager
        self._cursor = SendCursor(room)
        self._end = SenderEnd(self._side, manager.rank, manager.place)
        self._cleared = False
        self._state: dict[StateKind, list[int]] = {}

    @property
    def sent_pages(self) -> int:
        return self._cursor.sent

    def init(self, num_pages: int, slot: int) -> None:
        with self._lock:
            end = self._end
            if not accepts_call(self.room, self._side.status, "init()", ready=end.paired):
                return
            check_slot(self.room, slot, self._manager.metadata, "prefill")
            self._cursor.init(num_pages, slot)
            # Fewer pages cannot hold the prompt; more mean the decode was sent a longer one,
            # whose pages beyond ours would be read unwritten (the halves disagree).
            unlike = [len(r.pages) for r in end.dests.values() if len(r.pages) != num_pages]
            if unlike and self._group is not None:
                self._group.fail(Failure.everywhere(
                    PREFILL, f"the decode peer gave {unlike[0]} destination pages, {num_pages} "
                    "are needed (were the two workers sent the same prompt?)"))

    def send_state(self, state: Mapping[StateKind, Sequence[int]]) -> None:
        """The last chunk's state_indices (``kv.state_sends.StateSender``): they move with it."""
        items = {kind: [int(i) for i in values] for kind, values in state.items()}
        with self._lock:
            if self._side.status == KVPoll.FAILED:
                return
            why = check_state(self._manager.states, items, "prefill")
            if why or self._cursor.finished:
                raise TransferUsageError(self.room, why or "send_state() after the last chunk")
            self._state = items

    def send(self, pages: Sequence[int], last: bool) -> None:
        src = [int(p) for p in pages]
        manager = self._manager
        with self._lock:
            if self._side.status == KVPoll.FAILED:
                return
            end, group = self._end, self._group
            if self._cursor.num_pages is None or not end.paired or group is None:
                raise TransferUsageError(
                    self.room, f"send() before init() while {self._side.status.name}"
                )
            if manager._closed:
                raise TransferUsageError(self.room, "send() on a closed manager")
            check_pages(self.room, src, manager.pool, "prefill")
            span = self._cursor.advance(len(src), last)
            assert self._cursor.slot is not None and end.duty is not None
            if owed_state(manager.states, end.duty).status_only:
                self._side.status = KVPoll.TRANSFERRING
                if last:
                    group.sender_finished(end)
                return
            group.queue_chunk(end)
            dst = {d: r.pages[span] for d, r in end.dests.items()}
            manager._chunks.put(_Chunk(self, src, dst, last, self._cursor.slot,
                                       self._state if last else {}))

    # -- called with the lock held --------------------------------------------------------

    def _joined(self) -> End | None:
        return self._end

    def _forget(self) -> None:
        manager = self._manager
        if manager._senders.get(self.room) is self:
            del manager._senders[self.room]
        self._cleared = True
        server = manager._hub.lookup(manager.bootstrap_addr)
        if self._group is not None and server is not None:
            server.leave(self._group, self._end, manager)
