"""The write pipeline of a Mooncake prefill rank: chunks in, engine writes out.

Theory of operation
-------------------
:meth:`WritePipeline.submit` hands a chunk to one of ``num_workers`` worker threads, chosen by
the decode session, so a room's chunks stay in order. A worker takes every chunk queued at that
moment (at most ``_MAX_BATCH_CHUNKS``), groups them by decode session, coalesces their page
pairs into runs consecutive on both sides (:func:`kv.pages.coalesce`; a run may continue from
one request into the next) and submits one engine write covering every run in every region of
the pool (one block per run with the page-major layout, one per run and layer half with the
layer-major one: :mod:`kv.pool_layout`; a block longer than ``max_block_bytes`` is cut into
pieces of that size, :func:`cut_blocks`) and, with a draft pool, the same runs of it; then the
state items of the chunks that are last (one block per region and run of items,
:mod:`kv.mooncake_state`) and their metadata rows (one block per field and run of slots
consecutive on both sides, :func:`row_blocks`).

It submits the next write without waiting for the previous one while at most
``max_blocks_in_flight`` blocks (what the TCP transport queues per peer) are in flight, cutting
larger writes in halves of that, so the engine's lanes never drain between writes; it waits for
writes oldest first. With several engines (``MooncakeConfig.engines``) each of those writes is
dealt over them, block by block in turn, one engine write each, so their transports move a
group's blocks at once. Only after every write of a group completed does the group conclude
(:meth:`kv.mooncake_rooms.PrefillRooms.conclude`), and only then is decode told, so decode's
metadata gate never sees a torn row.

Failure: a write the engine refuses or reports failed fails the group's rooms with a reason
naming the decode session and blacklists the session; a group for a blacklisted session is not
written. An exception in a worker fails the rooms of its group; the worker keeps running.

Stop: :meth:`WritePipeline.close` writes what is queued and stops the workers; it says whether
every worker ended having waited for each of its engine writes (a worker still waiting on a hung
write, or one killed by what it does not catch, may leave a write in flight that lands later).
A construction whose worker fails to start (no thread to be had) stops the workers it started
before it raises, so none is left blocked on its queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kv.metadata import ASKED_FIELDS, MetadataBuffers
from kv.mooncake_engine import MooncakeConfig, MooncakeEngine
from kv.mooncake_legs import Chunk, Owed
from kv.mooncake_rooms import PrefillRooms
from kv.mooncake_slices import Target, slice_blocks, state_blocks
from kv.pages import coalesce
from kv.pool import KVPool

logger = logging.getLogger(__name__)

# At most this many queued chunks are merged into one engine call.
_MAX_BATCH_CHUNKS = 64


@attrs.define(eq=False)
class _Group:
    """Chunks for one decode session taken off the queue together; they conclude together
    once every engine write of theirs is done."""

    session: str
    chunks: list[Chunk]
    writes: int = 0  # engine writes in flight
    submitting: bool = False  # parts still to submit: the group cannot conclude yet
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
    engine: MooncakeEngine
    batch: int
    blocks: int


_Blocks = tuple[list[int], list[int], list[int]]  # source addresses, destinations, lengths


def cut_blocks(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, max_bytes: int) -> _Blocks:
    """The blocks ``(src[i], dst[i], lens[i])``, each longer than ``max_bytes`` cut into
    consecutive pieces of ``max_bytes`` (the last one shorter), in order."""
    pieces = -(-lens // max_bytes)
    if not len(lens) or pieces.max() <= 1:
        return src.tolist(), dst.tolist(), lens.tolist()
    block = np.repeat(np.arange(len(lens)), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (np.arange(len(block)) - first) * max_bytes
    return ((src[block] + offset).tolist(), (dst[block] + offset).tolist(),
            np.minimum(lens[block] - offset, max_bytes).tolist())


def _take(q: queue.SimpleQueue[Chunk | None], *, block: bool) -> tuple[list[Chunk], bool]:
    """The chunks queued now (waiting for the first when ``block``), and whether the stop
    marker came."""
    chunks: list[Chunk] = []
    while len(chunks) < _MAX_BATCH_CHUNKS:
        try:
            item = q.get() if block and not chunks else q.get_nowait()
        except queue.Empty:
            break
        if item is None:
            return chunks, True
        chunks.append(item)
    return chunks, False


def _by_layout(chunks: list[Chunk]) -> list[list[Chunk]]:
    """Consecutive chunks grouped while they share one decode registration (a session that
    registers again may bring another memory layout)."""
    groups: list[list[Chunk]] = []
    for c in chunks:
        if groups and groups[-1][0].leg.target is c.leg.target:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


class WritePipeline:
    """The transfer workers of one prefill rank; ``notify`` pushes the statuses owed."""

    def __init__(
        self,
        engines: Sequence[MooncakeEngine],
        pool: KVPool,
        metadata: MetadataBuffers,
        rooms: PrefillRooms,
        config: MooncakeConfig,
        notify: Callable[[Sequence[Owed]], None],
    ) -> None:
        self._engines = tuple(engines)
        self._pool = pool
        infos = metadata.buffer_infos()
        self._metadata = metadata
        self._meta_ptrs = [i.ptr for i in infos]
        self._meta_item_lens = [i.item_len for i in infos]
        self._meta_names = [i.name for i in infos]
        self._rooms = rooms
        self._max_blocks = config.max_blocks_in_flight
        self._max_block_bytes = config.max_block_bytes
        self._notify = notify
        self._queues: list[queue.SimpleQueue[Chunk | None]] = [
            queue.SimpleQueue() for _ in range(config.num_workers)
        ]
        self._threads = [
            threading.Thread(target=self._work, args=(q,), name=f"mooncake-xfer-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        # Workers that ended with no engine write of theirs in flight (appended by each).
        self._ended: list[str] = []
        started = 0
        try:
            for t in self._threads:
                t.start()
                started += 1
        except BaseException:
            # A worker that did not start (no thread to be had) leaves those that did blocked
            # on their queues for ever: they are stopped before the failure goes on.
            self._threads = self._threads[:started]
            self.close()
            raise

    def submit(self, chunk: Chunk) -> None:
        session = chunk.session
        self._queues[zlib.crc32(session.encode()) % len(self._queues)].put(chunk)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write what is queued, then stop the workers, waiting at most ``timeout_s`` for each.
        Whether every worker ended with none of its engine writes in flight: no write of this
        pipeline can land any more once its engines are closed."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=timeout_s)
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("transfer workers %s still running %g s after the stop (a write "
                           "that does not conclude?)", ", ".join(stuck), timeout_s)
        return len(self._ended) == len(self._threads)

    def _work(self, q: queue.SimpleQueue[Chunk | None]) -> None:
        """Submit writes as chunks arrive while earlier writes are still in flight, so the
        engine's queue does not drain between them; conclude writes oldest first."""
        inflight: deque[_Write] = deque()
        stopping = False
        while not stopping or inflight:
            chunks: list[Chunk] = []
            if not stopping:
                chunks, stopping = _take(q, block=not inflight)
            if chunks:
                # Chunks that queued up together go out together: one engine call per session
                # instead of one per chunk, in queue order (so a room's chunks too).
                by_session: dict[str, list[Chunk]] = {}
                for c in chunks:
                    by_session.setdefault(c.session, []).append(c)
                for session, group in by_session.items():
                    self._start(_Group(session, group), inflight)
            elif inflight:
                self._finish(inflight.popleft())
        self._ended.append(threading.current_thread().name)

    def _start(self, group: _Group, inflight: deque[_Write]) -> None:
        """Submit the group's writes, first waiting for the oldest writes in flight while the
        engines hold ``max_blocks_in_flight`` blocks; none to a blacklisted session. Each part's
        blocks are dealt over the engines in turn, one write per engine. A group with nothing
        in flight concludes at once, and a group concludes only once all its parts are
        submitted (a budget of one block waits for a group's own writes between its parts)."""
        engines = self._engines
        group.submitting = True
        try:
            for src, dst, lens in self._parts(group):
                while inflight and (sum(w.blocks for w in inflight) + len(src)
                                    > self._max_blocks):
                    self._finish(inflight.popleft())
                if self._rooms.blacklisted(group.session):
                    group.error = (f"decode session {group.session} is blacklisted after an "
                                   "earlier failure")
                    break
                n = min(len(engines), len(src))
                for k in range(n):
                    engine = engines[k]
                    share = (src[k::n], dst[k::n], lens[k::n]) if n > 1 else (src, dst, lens)
                    batch = engine.submit_write(group.session, *share)
                    if not batch:
                        group.fail(f"the transfer engine refused a write of rooms "
                                   f"{group.live_rooms} to decode session {group.session}")
                        break
                    group.writes += 1
                    inflight.append(_Write(group, engine, batch, len(share[0])))
                if group.engine_failed:
                    break
        except Exception as exc:  # becomes failed rooms, never a dead worker
            logger.exception("transfer worker failed writing to %s", group.session)
            group.error = group.error or f"internal error in transfer worker: {exc!r}"
        group.submitting = False
        if not group.writes:
            self._conclude(group)

    def _finish(self, write: _Write) -> None:
        group = write.group
        try:
            rc = write.engine.wait(write.batch)
        except Exception:  # a failed write, never a dead worker
            logger.exception("waiting for a write to %s failed", group.session)
            rc = -1
        if rc != 0:
            group.fail(f"transfer engine write of rooms {group.live_rooms} to decode session "
                       f"{group.session} failed (rc={rc})")
        group.writes -= 1
        if not group.writes and not group.submitting:
            self._conclude(group)

    def _conclude(self, group: _Group) -> None:
        self._notify(self._rooms.conclude(
            group.chunks, group.session, group.error, group.engine_failed
        ))

    def _parts(self, group: _Group) -> list[_Blocks]:
        """The blocks of the group's live chunks, then the metadata rows of those that are
        last, cut into engine writes of at most half ``max_blocks_in_flight`` blocks, so one
        can be queued while another is in flight."""
        live = self._rooms.live(group.chunks)
        group.live_rooms = sorted({c.rec.room for c in live})
        src: list[int] = []
        dst: list[int] = []
        lens: list[int] = []
        # Chunks for one destination layout coalesce together, so a run that continues from
        # one request into the next on both sides is one block.
        for same_layout in _by_layout(live):
            target = same_layout[0].leg.target
            for blocks in (self._blocks(same_layout, target), self._state(same_layout, target),
                           self._rows(same_layout, target)):
                src += blocks[0]
                dst += blocks[1]
                lens += blocks[2]
        step = max(1, self._max_blocks // 2)
        return [(src[i : i + step], dst[i : i + step], lens[i : i + step])
                for i in range(0, len(src), step)]

    def _blocks(self, chunks: list[Chunk], target: Target) -> _Blocks:
        """Addresses and lengths of what the chunks' runs of pages write into the target
        (:func:`kv.mooncake_slices.slice_blocks`: whole pages are one block per run page-major,
        one per run and layer half layer-major; head slices one per token slot)."""
        runs = coalesce([p for c in chunks for p in c.src],
                        np.concatenate([c.dst for c in chunks]).tolist())
        src, dst, lens = slice_blocks(target.src, target.dst, runs, target.slices)
        src, dst = src + self._pool.buffer.data_ptr(), dst + target.reg.kv_ptr
        if target.state.draft is not None:  # the draft pool's copies of the same pages
            more = state_blocks(target, "draft", [p for c in chunks for p in c.src],
                                np.concatenate([c.dst for c in chunks]).tolist())
            src, dst, lens = (np.concatenate(p) for p in zip((src, dst, lens), more, strict=True))
        return cut_blocks(src, dst, lens, self._max_block_bytes)

    def _state(self, chunks: list[Chunk], target: Target) -> _Blocks:
        """The state items of the chunks that are last, by kind: this rank's share of each
        (:func:`kv.mooncake_slices.state_blocks`)."""
        parts = [state_blocks(target, str(kind), items, chunk.leg.dest.state[kind].tolist())
                 for chunk in chunks if chunk.last for kind, items in chunk.state.items()]
        if not parts:
            return [], [], []
        src, dst, lens = (np.concatenate(p) for p in zip(*parts, strict=True))
        return cut_blocks(src, dst, lens, self._max_block_bytes)

    def _rows(self, chunks: list[Chunk], target: Target) -> _Blocks:
        """The metadata rows of the chunks that are last, every field (none from a stage that
        does not compute the first token), but the named ids' logprobs only when one of the
        rows carries them: each field is a block per run of slots, and a request that did not
        name ids never reads them."""
        if not target.rows:
            return [], [], []
        last = [c for c in chunks if c.last]
        slots = [c.rec.cursor.slot or 0 for c in last]
        fields = row_fields(self._meta_names,
                            named=any(self._metadata.names_ids(slot) for slot in slots))
        return row_blocks(slots, [c.leg.dest.slot for c in last],
                          [self._meta_ptrs[f] for f in fields],
                          [self._meta_item_lens[f] for f in fields],
                          [target.reg.meta_ptrs[f] for f in fields])


def row_fields(names: Sequence[str], *, named: bool) -> list[int]:
    """The metadata fields (indices into ``names``) a group of rows sends: every one, but the
    named ids' logprobs only when one of the rows carries them (``named``)."""
    return [f for f, name in enumerate(names) if named or name not in ASKED_FIELDS]


def row_blocks(slots: Sequence[int], dst_slots: Sequence[int], ptrs: Sequence[int],
               item_lens: Sequence[int], dst_ptrs: Sequence[int]) -> _Blocks:
    """Blocks moving metadata row ``slots[i]`` of every field (``ptrs[f] + slot *
    item_lens[f]``) to row ``dst_slots[i]`` of the same field at ``dst_ptrs[f]``, field by field
    in order, so the room's (the last field) come last. Rows consecutive on both sides go as one
    block per field: requests that finish together mostly hold consecutive slots on both sides
    (both allocators are FIFO), and on the TCP transport every block costs a round trip on its lane,
    which a 64-byte row does not amortise."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    runs = coalesce([slots[i] for i in order], [dst_slots[i] for i in order])
    src: list[int] = []
    dst: list[int] = []
    lens: list[int] = []
    for ptr, item, dptr in zip(ptrs, item_lens, dst_ptrs, strict=True):
        for run in runs:
            src.append(ptr + run.src_start * item)
            dst.append(dptr + run.dst_start * item)
            lens.append(run.length * item)
    return src, dst, lens
