"""The prefill side of the Mooncake transfer backend: the manager and the per-room sender.

Theory of operation
-------------------
Both sides own a Mooncake ``TransferEngine`` (:mod:`kv.mooncake_engine`; handshake
``P2PHANDSHAKE``, TCP here, RDMA where configured) with their KV pool tensor and metadata buffers
registered. The prefill side only ever *writes* into decode memory; decode never reads prefill
memory. The decode side is :mod:`kv.mooncake_decode`.

Control messages (:mod:`kv.wire`) travel over ZeroMQ PUSH → PULL. Decode looks the prefill rank
up at the bootstrap endpoint (:mod:`kv.bootstrap`), refuses one whose page size or KV dtype
differs, and sends one ``Register`` with its session and memory layout; then, per room, a
``Destination`` (pages and metadata slot) or an ``Abort``. The prefill listener thread validates
every message and drops (logs, counts) bad ones; it never dies of one.

Prefill rooms move BOOTSTRAPPING → WAITING_FOR_INPUT (destination arrived) → TRANSFERRING (first
chunk queued) → SUCCESS / FAILED. ``send()`` hands a chunk to one of N worker threads chosen by
the decode session, so a room's chunks stay in order. A worker takes every chunk queued at that
moment, coalesces their page pairs into runs (:func:`kv.pages.coalesce`; a run may continue from
one request into the next) and submits one engine write covering every run of every layer's K
and V, then the metadata rows of the chunks that are last. It submits the next write without
waiting for the previous one while at most ``max_blocks_in_flight`` blocks (what the TCP
transport queues per peer) are in flight, cutting larger writes in halves of that, so the
engine's lanes never drain between writes; it waits for writes oldest first. Only after every
write of a chunk group completed does the worker push ``Status`` to decode, so decode's
metadata gate (SUCCESS needs the row's room to match) never sees a torn row.

Failure: a non-zero engine return fails the room with a reason naming the decode session and
blacklists the session: its other live rooms fail at once (they cannot succeed) and later chunks
to it are skipped, while other sessions are untouched. A fresh ``Register`` from the session
clears the blacklist. A dead decode peer fails within about a second (TCP connection refused).
A worker exception fails its room; the worker keeps running. An ``Abort`` from decode fails the
room with ``REASON_PEER_ABORTED``. Readiness goes to ``ready``.

Rooms: ``clear()`` forgets a room and leaves a tombstone, so a late ``Destination``/``Abort`` for
it is ignored instead of poisoning a later request that reuses the room number. ``quiescent()``
is False while a chunk of the room is queued or being written.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import zmq

from kv import wire
from kv.bootstrap import BootstrapClient, RankInfo
from kv.metadata import MetadataBuffers
from kv.mooncake_engine import (
    Engine,
    MooncakeConfig,
    kv_dtype_name,
    push_socket,
    register_all,
    serve_control,
)
from kv.pages import coalesce
from kv.pool import KVPool
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

_TOMBSTONES = 65536
# At most this many queued chunks are merged into one engine call.
_MAX_BATCH_CHUNKS = 64


@attrs.define(eq=False)
class _Room:
    room: int
    created: float
    status: KVPoll = KVPoll.BOOTSTRAPPING
    reason: str = ""
    timed_out: bool = False
    dest: wire.Destination | None = None
    reg: wire.Register | None = None
    cursor: SendCursor = attrs.field(init=False)
    in_flight: int = 0
    # Decode was told of the failure, after the room went quiescent (see _settle).
    notified: bool = False

    def __attrs_post_init__(self) -> None:
        self.cursor = SendCursor(self.room)


@attrs.frozen(eq=False)
class _Chunk:
    rec: _Room
    src: Sequence[int]
    dst: np.ndarray
    last: bool


@attrs.define(eq=False)
class _Group:
    """Chunks for one decode session taken off the queue together; they conclude together
    once every engine write of theirs is done."""

    session: str
    chunks: list[_Chunk]
    writes: int = 0  # engine writes in flight
    error: str | None = None
    engine_failed: bool = False
    live_rooms: list[int] = attrs.Factory(list)  # the rooms the writes are for

    def fail(self, reason: str) -> None:
        """An engine failure: the first reason stands, the session is blacklisted."""
        self.error = self.error or reason
        self.engine_failed = True


@attrs.frozen(eq=False)
class _Write:
    group: _Group
    batch: int
    blocks: int


def _take(q: queue.SimpleQueue[_Chunk | None], *, block: bool) -> tuple[list[_Chunk], bool]:
    """The chunks queued now (waiting for the first when ``block``), and whether the stop
    marker came."""
    chunks: list[_Chunk] = []
    while len(chunks) < _MAX_BATCH_CHUNKS:
        try:
            item = q.get() if block and not chunks else q.get_nowait()
        except queue.Empty:
            break
        if item is None:
            return chunks, True
        chunks.append(item)
    return chunks, False


def _by_layout(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """Consecutive chunks grouped while their rooms share one decode registration (a session
    that registers again may bring another memory layout)."""
    groups: list[list[_Chunk]] = []
    for c in chunks:
        if groups and groups[-1][0].rec.reg is c.rec.reg:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


class MooncakeKVManager:
    """Prefill rank: engine, control listener, transfer workers; creates senders."""

    def __init__(
        self,
        pool: KVPool,
        metadata: MetadataBuffers,
        *,
        rank: int = 0,
        config: MooncakeConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or MooncakeConfig()
        self.pool = pool
        self.metadata = metadata
        self.rank = rank
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.dropped_messages = wire.DroppedMessages()
        self._clock = clock
        infos = metadata.buffer_infos()
        self._meta_ptrs = [i.ptr for i in infos]
        self._meta_item_lens = [i.item_len for i in infos]
        self._num_slots = metadata.num_slots
        self._engine = Engine(self.config)
        register_all(self._engine, pool, metadata)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{self.config.hostname}")
        self.endpoint = f"tcp://{self.config.hostname}:{port}"
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._early: OrderedDict[int, wire.Destination] = OrderedDict()
        self._tombstones: OrderedDict[int, None] = OrderedDict()
        self._sessions: dict[str, wire.Register] = {}
        self._failed_sessions: set[str] = set()
        self._push_lock = threading.Lock()
        self._push: dict[str, zmq.Socket[Any]] = {}
        self._stop = threading.Event()
        self._queues: list[queue.SimpleQueue[_Chunk | None]] = [
            queue.SimpleQueue() for _ in range(self.config.num_workers)
        ]
        self._threads = [threading.Thread(target=self._listen, name="mooncake-listen", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, args=(q,), name=f"mooncake-xfer-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    @property
    def session(self) -> str:
        return self._engine.session

    def rank_info(self) -> RankInfo:
        return RankInfo(
            rank=self.rank,
            endpoint=self.endpoint,
            session=self.session,
            page_size=self.pool.page_size,
            kv_dtype=kv_dtype_name(self.pool),
        )

    def register_to_bootstrap(self, bootstrap_addr: str) -> None:
        BootstrapClient(bootstrap_addr, token=self.config.token).register(self.rank_info())

    def create_sender(self, bootstrap_addr: str, room: int) -> MooncakeKVSender:
        with self._lock:
            if room in self._rooms:
                raise TransferUsageError(room, "a live sender exists for this room; clear() it")
            rec = _Room(room=room, created=self._clock())
            self._rooms[room] = rec
            self._tombstones.pop(room, None)
            early = self._early.pop(room, None)
            if early is not None:
                self._accept_destination(rec, early)
        return MooncakeKVSender(self, rec)

    def live_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    def close(self) -> None:
        self._stop.set()
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        with self._push_lock:
            for sock in self._push.values():
                sock.close()
            self._push.clear()
        self._pull.close()
        self._ctx.term()
        self._engine.close()

    # -- control messages (listener thread) --------------------------------------------------

    def _listen(self) -> None:
        serve_control(
            self._pull, self._stop, self.config.token, self._handle, self.dropped_messages, logger
        )

    def _handle(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.Register):
            self._on_register(msg)
        elif isinstance(msg, wire.Destination):
            self._on_destination(msg)
        elif isinstance(msg, wire.Abort):
            self._on_abort(msg)
        else:
            raise wire.WireError("unexpected_type", f"{type(msg).__name__} is not for prefill")

    def _on_register(self, reg: wire.Register) -> None:
        mine = (self.pool.page_size, kv_dtype_name(self.pool), self.pool.page_bytes,
                self.pool.num_layers, tuple(self._meta_item_lens))
        theirs = (reg.page_size, reg.kv_dtype, reg.page_bytes, reg.num_layers, reg.meta_item_lens)
        if mine != theirs:
            raise wire.WireError(
                "incompatible_layout",
                f"session {reg.session}: (page_size, kv_dtype, page_bytes, layers, metadata item "
                f"lens) {theirs} differ from this rank's {mine}",
            )
        with self._lock:
            self._sessions[reg.session] = reg
            self._failed_sessions.discard(reg.session)
        with self._push_lock:
            old = self._push.pop(reg.session, None)
            if old is not None:
                old.close()
            self._push[reg.session] = push_socket(self._ctx, reg.status_endpoint)
        logger.info("decode session %s registered", reg.session)

    def _on_destination(self, dest: wire.Destination) -> None:
        with self._lock:
            wire.check_destination(dest, self._sessions)
            rec = self._rooms.get(dest.room)
            if rec is None:
                if dest.room in self._tombstones:
                    raise wire.WireError("stale_room", f"room {dest.room} was already cleared")
                self._early[dest.room] = dest
                if len(self._early) > self.config.max_early_destinations:
                    evicted, _ = self._early.popitem(last=False)
                    raise wire.WireError("early_overflow", f"evicted early room {evicted}")
                return
            if rec.dest is not None:
                raise wire.WireError("duplicate_destination", f"room {dest.room}")
            self._accept_destination(rec, dest)

    def _accept_destination(self, rec: _Room, dest: wire.Destination) -> None:
        rec.dest = dest
        rec.reg = self._sessions[dest.session]
        if rec.status == KVPoll.BOOTSTRAPPING:
            rec.status = KVPoll.WAITING_FOR_INPUT
            self.ready.put(rec.room)

    def _on_abort(self, msg: wire.Abort) -> None:
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
            owed = self._settle(rec)
        if owed is not None:
            self._send_status(*owed)

    # -- room state (callers hold self._lock) ------------------------------------------------

    def _fail(self, rec: _Room, reason: str, *, timed_out: bool = False) -> bool:
        if rec.status in TERMINAL:
            return False
        rec.status = KVPoll.FAILED
        rec.reason = reason
        rec.timed_out = timed_out
        self.ready.put(rec.room)
        return True

    def _settle(self, rec: _Room) -> tuple[str, int, KVPoll, str] | None:
        """The FAILED status owed to decode once a failed room is quiescent, if any.

        Decode reads this status as "prefill no longer writes into these pages", so it is sent
        only when no chunk of the room is queued or being written.
        """
        if rec.status != KVPoll.FAILED or rec.in_flight or rec.notified:
            return None
        rec.notified = True
        if rec.dest is not None:
            self.ready.put(rec.room)  # quiescence is news to the owner of the pages
            return (rec.dest.session, rec.room, KVPoll.FAILED, rec.reason)
        return None

    def _live(self, rec: _Room) -> bool:
        return self._rooms.get(rec.room) is rec and rec.status not in TERMINAL

    # -- transfer workers ---------------------------------------------------------------------

    def _enqueue(self, chunk: _Chunk, session: str) -> None:
        self._queues[zlib.crc32(session.encode()) % len(self._queues)].put(chunk)

    def _work(self, q: queue.SimpleQueue[_Chunk | None]) -> None:
        """Submit writes as chunks arrive while earlier writes are still in flight, so the
        engine's queue does not drain between them; conclude writes oldest first."""
        inflight: deque[_Write] = deque()
        stopping = False
        while not stopping or inflight:
            chunks: list[_Chunk] = []
            if not stopping:
                chunks, stopping = _take(q, block=not inflight)
            if chunks:
                # Chunks that queued up together go out together: one engine call per session
                # instead of one per chunk, in queue order (so a room's chunks too).
                by_session: dict[str, list[_Chunk]] = {}
                for c in chunks:
                    assert c.rec.dest is not None
                    by_session.setdefault(c.rec.dest.session, []).append(c)
                for session, group in by_session.items():
                    self._start(_Group(session, group), inflight)
            elif inflight:
                self._finish(inflight.popleft())

    def _start(self, group: _Group, inflight: deque[_Write]) -> None:
        """Submit the group's writes, first waiting for the oldest writes in flight while the
        engine holds ``max_blocks_in_flight`` blocks; none to a blacklisted session. A group
        with nothing in flight concludes at once."""
        try:
            for src, dst, lens in self._parts(group):
                while inflight and (sum(w.blocks for w in inflight) + len(src)
                                    > self.config.max_blocks_in_flight):
                    self._finish(inflight.popleft())
                with self._lock:
                    if group.session in self._failed_sessions:
                        group.error = (f"decode session {group.session} is blacklisted after "
                                       "an earlier failure")
                        break
                batch = self._engine.submit_write(group.session, src, dst, lens)
                if not batch:
                    group.fail(f"the transfer engine refused a write of rooms {group.live_rooms} "
                               f"to decode session {group.session}")
                    break
                group.writes += 1
                inflight.append(_Write(group, batch, len(src)))
        except Exception as exc:  # becomes failed rooms, never a dead worker
            logger.exception("transfer worker failed writing to %s", group.session)
            group.error = group.error or f"internal error in transfer worker: {exc!r}"
        if not group.writes:
            self._conclude(group)

    def _finish(self, write: _Write) -> None:
        group = write.group
        try:
            rc = self._engine.wait(write.batch)
        except Exception:  # a failed write, never a dead worker
            logger.exception("waiting for a write to %s failed", group.session)
            rc = -1
        if rc != 0:
            group.fail(f"transfer engine write of rooms {group.live_rooms} to decode session "
                       f"{group.session} failed (rc={rc})")
        group.writes -= 1
        if not group.writes:
            self._conclude(group)

    def _conclude(self, group: _Group) -> None:
        session, error = group.session, group.error
        notify: list[tuple[str, int, KVPoll, str] | None] = []
        with self._lock:
            for chunk in group.chunks:
                rec = chunk.rec
                rec.in_flight -= 1
                if error is not None:
                    self._fail(rec, error)
                elif chunk.last and self._live(rec):
                    rec.status = KVPoll.SUCCESS
                    self.ready.put(rec.room)
                    notify.append((session, rec.room, KVPoll.SUCCESS, ""))
            if group.engine_failed and session not in self._failed_sessions:
                self._failed_sessions.add(session)
                notify += self._fail_session(session)
            notify += [self._settle(chunk.rec) for chunk in group.chunks]
        for owed in notify:
            if owed is not None:
                self._send_status(*owed)

    def _fail_session(self, session: str) -> list[tuple[str, int, KVPoll, str] | None]:
        """Fail every live room of a blacklisted session: none of them can succeed."""
        reason = f"decode session {session} was blacklisted after a failed transfer"
        failed = [r for r in self._rooms.values()
                  if r.dest is not None and r.dest.session == session and self._fail(r, reason)]
        return [self._settle(r) for r in failed]

    def _parts(self, group: _Group) -> list[tuple[list[int], list[int], list[int]]]:
        """The blocks of the group's live chunks, then the metadata rows of those that are
        last, cut into engine writes of at most half ``max_blocks_in_flight`` blocks, so one
        can be queued while another is in flight."""
        with self._lock:
            live = [c for c in group.chunks if self._live(c.rec)]
        group.live_rooms = sorted({c.rec.room for c in live})
        src: list[int] = []
        dst: list[int] = []
        lens: list[int] = []
        # Chunks for one destination layout coalesce together, so a run that continues from
        # one request into the next on both sides is one block.
        for same_layout in _by_layout(live):
            reg = same_layout[0].rec.reg
            assert reg is not None
            s, d, n = self._blocks([p for c in same_layout for p in c.src],
                                   np.concatenate([c.dst for c in same_layout]), reg)
            src += s
            dst += d
            lens += n
            for chunk in same_layout:
                rec = chunk.rec
                assert rec.dest is not None
                if chunk.last:
                    slot, dst_slot = rec.cursor.slot or 0, rec.dest.slot
                    for ptr, item, dptr in zip(self._meta_ptrs, self._meta_item_lens,
                                               reg.meta_ptrs, strict=True):
                        src.append(ptr + slot * item)
                        dst.append(dptr + dst_slot * item)
                        lens.append(item)
        step = max(1, self.config.max_blocks_in_flight // 2)
        return [(src[i : i + step], dst[i : i + step], lens[i : i + step])
                for i in range(0, len(src), step)]

    def _blocks(
        self, src_pages: Sequence[int], dst_pages: np.ndarray, reg: wire.Register
    ) -> tuple[list[int], list[int], list[int]]:
        """Addresses and lengths of every run of every layer half, layer-half major."""
        runs = coalesce(src_pages, dst_pages.tolist())
        if not runs:
            return [], [], []
        r = np.array(runs, dtype=np.int64)
        pb = self.pool.page_bytes
        halves = np.arange(2 * self.pool.num_layers, dtype=np.int64)[:, None]
        src_base = self.pool.buffer.data_ptr()
        src = src_base + (halves * self.pool.num_pages + r[:, 0]) * pb
        dst = reg.kv_ptr + (halves * reg.num_pages + r[:, 1]) * pb
        lens = np.broadcast_to(r[:, 2] * pb, src.shape)
        return src.ravel().tolist(), dst.ravel().tolist(), lens.ravel().tolist()

    def _send_status(self, session: str, room: int, poll: KVPoll, reason: str) -> None:
        data = wire.encode(wire.Status(room, int(poll), reason, self.rank), self.config.token)
        with self._push_lock:
            sock = self._push.get(session)
            if sock is None:
                return
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # a dead peer's queue is full; its rooms already failed
                logger.warning("status for room %d to %s not sent: %s", room, session, exc)


class MooncakeKVSender:
    """The prefill side of one room (see :mod:`kv.transfer` for the contract)."""

    def __init__(self, mgr: MooncakeKVManager, rec: _Room) -> None:
        self.room = rec.room
        self._mgr = mgr
        self._rec = rec
        self._latched: KVPoll | None = None

    def init(self, num_pages: int, slot: int) -> None:
        mgr, rec = self._mgr, self._rec
        if not 0 <= slot < mgr._num_slots:
            raise TransferUsageError(self.room, f"slot {slot} not in 0..{mgr._num_slots - 1}")
        with mgr._lock:
            if rec.status == KVPoll.FAILED:
                return
            if rec.status != KVPoll.WAITING_FOR_INPUT or rec.dest is None:
                raise TransferUsageError(self.room, f"init() while {rec.status.name}")
            rec.cursor.init(num_pages, slot)
            if num_pages > len(rec.dest.pages):
                mgr._fail(rec, f"decode session {rec.dest.session} offered "
                               f"{len(rec.dest.pages)} pages, the request needs {num_pages}")
                owed = mgr._settle(rec)
            else:
                owed = None
        if owed is not None:
            mgr._send_status(*owed)

    def send(self, pages: Sequence[int], last: bool) -> None:
        mgr, rec = self._mgr, self._rec
        with mgr._lock:
            if rec.status == KVPoll.FAILED:
                return
            if rec.cursor.num_pages is None or rec.dest is None:
                raise TransferUsageError(self.room, f"send() before init() while {rec.status.name}")
            span = rec.cursor.advance(len(pages), last)
            if not mgr._live(rec) or (not pages and not last):
                return
            dst = rec.dest.pages[span]
            rec.in_flight += 1
            rec.status = KVPoll.TRANSFERRING
            session = rec.dest.session
        mgr._enqueue(_Chunk(rec, list(pages), dst, last), session)

    def poll(self) -> KVPoll:
        if self._latched is not None:
            return self._latched
        mgr, rec = self._mgr, self._rec
        with mgr._lock:
            status = rec.status
            if status == KVPoll.BOOTSTRAPPING:
                waited = mgr._clock() - rec.created
                if waited >= mgr.config.bootstrap_timeout_s:
                    mgr._fail(rec, f"no destination from decode after {waited:.1f}s "
                                   "(bootstrap timeout)", timed_out=True)
                    status = rec.status
        if status in TERMINAL:
            self._latched = status
        return status

    def failure_exception(self) -> TransferError:
        rec = self._rec
        peer = rec.dest.session if rec.dest is not None else ""
        if rec.status != KVPoll.FAILED:
            return TransferError(rec.room, REASON_OTHER_RANK, peer)
        return TransferError(rec.room, rec.reason, peer, timeout=rec.timed_out)

    def abort(self) -> None:
        mgr, rec = self._mgr, self._rec
        with mgr._lock:
            mgr._fail(rec, REASON_ABORTED)
            owed = mgr._settle(rec)
        if owed is not None:
            mgr._send_status(*owed)

    def clear(self) -> None:
        mgr = self._mgr
        with mgr._lock:
            if mgr._rooms.get(self.room) is self._rec:
                del mgr._rooms[self.room]
                mgr._early.pop(self.room, None)
                mgr._tombstones[self.room] = None
                if len(mgr._tombstones) > _TOMBSTONES:
                    mgr._tombstones.popitem(last=False)

    def quiescent(self) -> bool:
        with self._mgr._lock:
            return self._rec.in_flight == 0
