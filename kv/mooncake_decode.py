"""The decode side of the Mooncake backend: the manager that registers with a prefill rank,
and the per-request receiver (the prefill side is :mod:`kv.mooncake`).

The decode manager looks the prefill rank up at its bootstrap endpoint, refuses one that serves
another model (:mod:`kv.model_id`) or whose page size, KV dtype or pool layout differs, sends one
``Register`` with its engine session, memory layout and model, and
then per room a ``Destination`` or an ``Abort``; a room it will never ask for (refused, or failed
before its destination) it reports to the prefill's bootstrap endpoint instead
(:meth:`MooncakeDecodeManager.refuse`, :mod:`kv.refusal`). A receiver reports SUCCESS only when
prefill's ``Status`` said so *and* the metadata row in its slot carries its own room (the
metadata gate); a FAILED ``Status`` fails it with prefill's reason (``REASON_ABORTED`` when
prefill aborted the room, a refusal when prefill refused it). Any ``Status`` also means
prefill no longer writes the room's pages, which is what :meth:`MooncakeKVReceiver.quiescent`
reports.

Heartbeat (as SGLang's decode side): a thread checks the prefill bootstrap's ``/health`` every
``heartbeat_interval_s``. After ``heartbeat_max_failures`` failures in a row the prefill counts
as gone: every room not yet concluded fails with a reason naming it and is quiescent (a prefill
that is gone writes nothing more), and receivers created meanwhile fail at once. When the health
check answers again, the manager looks the prefill rank up again and sends a fresh
``Register``, so a restarted prefill server is used without restarting decode.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import attrs
import numpy as np

from kv import wire
from kv.bootstrap import BootstrapClient, BootstrapError, RankInfo
from kv.metadata import MetadataBuffers, MetadataError
from kv.model_id import describe_model
from kv.mooncake_engine import (
    ControlEndpoint,
    IncompatiblePeerError,
    MooncakeConfig,
    MooncakeError,
    PeerAuthError,
    kv_dtype_name,
    push_socket,
)
from kv.pool import KVPool
from kv.refusal import RefusalPoster
from kv.transfer import REASON_ABORTED, KVPoll, TransferError, TransferUsageError, accepts_call

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class _DecodeRoom:
    room: int
    status: KVPoll = KVPoll.BOOTSTRAPPING
    reason: str = ""
    slot: int = -1
    # Destination sent, and no Status back yet: prefill may still write into the pages.
    awaiting_prefill: bool = False
    row_landed: bool = False


class MooncakeDecodeManager:
    """Decode side: engine, status listener, one registration with prefill rank ``rank``."""

    def __init__(
        self,
        pool: KVPool,
        metadata: MetadataBuffers,
        bootstrap_addr: str,
        *,
        rank: int = 0,
        config: MooncakeConfig | None = None,
    ) -> None:
        self.config = config or MooncakeConfig()
        self.pool = pool
        self.metadata = metadata
        self.bootstrap_addr = bootstrap_addr
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._refusals = RefusalPoster(token=self.config.token)
        self.prefill = self._lookup(bootstrap_addr, rank)
        self._control = ControlEndpoint(
            self.config, pool, metadata, self._handle, name="mooncake-status", log=logger
        )
        self.dropped_messages = self._control.dropped_messages
        self._lock = threading.Lock()
        self._rooms: dict[int, _DecodeRoom] = {}
        # Cleared rooms whose Status (prefill's "no more writes") has not come back yet.
        self._draining: dict[int, _DecodeRoom] = {}
        self._push_lock = threading.Lock()
        self._push = push_socket(self._control.ctx, self.prefill.endpoint)
        # Why the prefill counts as gone (see the heartbeat), or None while it answers.
        self._lost: str | None = None
        infos = metadata.buffer_infos()
        self._register = wire.Register(
            session=self._control.session,
            status_endpoint=self._control.endpoint,
            kv_ptr=pool.buffer.data_ptr(),
            num_layers=pool.num_layers,
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            page_bytes=pool.page_bytes,
            kv_dtype=kv_dtype_name(pool),
            meta_ptrs=tuple(i.ptr for i in infos),
            meta_item_lens=tuple(i.item_len for i in infos),
            num_slots=metadata.num_slots,
            model=pool.model,
            model_name=pool.model_name,
            kv_layout=pool.layout.value,
        )
        self._send(self._register)
        # The status socket is bound, so nothing sent to it is lost before its thread runs.
        self._control.start()
        self._heartbeat = threading.Thread(
            target=self._watch_prefill, name="mooncake-heartbeat", daemon=True
        )
        self._heartbeat.start()

    @property
    def session(self) -> str:
        return self._control.session

    @property
    def lost(self) -> str | None:
        """Why the prefill counts as gone, or None while its health check answers."""
        with self._lock:
            return self._lost

    def _lookup(self, bootstrap_addr: str, rank: int) -> RankInfo:
        """The prefill rank's entry, waiting up to ``connect_timeout_s`` for all ranks."""
        client = BootstrapClient(bootstrap_addr, token=self.config.token)
        deadline = time.monotonic() + self.config.connect_timeout_s
        while True:
            try:
                table = client.lookup()
                break
            except BootstrapError as exc:
                if exc.status == 401:
                    raise PeerAuthError(
                        f"prefill bootstrap {bootstrap_addr} refused this decode's peer token "
                        f"({'none was sent' if self.config.token is None else 'a wrong one'}): "
                        "start both workers with the same --peer-token-file or "
                        "PDLIFE_PEER_TOKEN") from exc
                if exc.status not in (0, 503) or time.monotonic() >= deadline:
                    raise MooncakeError(f"prefill bootstrap lookup failed: {exc}") from exc
                if self._stop.wait(0.05):  # closing
                    raise MooncakeError("prefill bootstrap lookup stopped: closing") from exc
        if self.config.token is not None and not table.token_required:
            raise PeerAuthError(
                f"prefill at {bootstrap_addr} does not authenticate its peers but this decode "
                "has a peer token (it would drop prefill's unauthenticated statuses): start "
                "both workers with the same --peer-token-file or PDLIFE_PEER_TOKEN")
        if table.model != self.pool.model:
            mine = describe_model(self.pool.model_name, self.pool.model)
            raise IncompatiblePeerError(
                f"prefill at {bootstrap_addr} serves model {table.model_label}, this decode "
                f"serves {mine}: one model's KV means nothing to another; start both with the "
                "same --model and --dtype")
        dtype, layout = kv_dtype_name(self.pool), self.pool.layout.value
        if (table.page_size, table.kv_dtype, table.kv_layout) != (
                self.pool.page_size, dtype, layout):
            raise IncompatiblePeerError(
                f"prefill at {bootstrap_addr} has page_size={table.page_size} "
                f"kv_dtype={table.kv_dtype} kv_layout={table.kv_layout}, this decode pool has "
                f"page_size={self.pool.page_size} kv_dtype={dtype} kv_layout={layout}; start "
                "both with the same --page-size, --dtype and --kv-layout"
            )
        ranks = {r.rank: r for r in table.ranks}
        if rank not in ranks:
            raise MooncakeError(f"prefill at {bootstrap_addr} has no rank {rank}")
        return ranks[rank]

    def create_receiver(self, bootstrap_addr: str, room: int) -> MooncakeKVReceiver:
        if bootstrap_addr != self.bootstrap_addr:
            raise TransferUsageError(
                room, f"this manager serves prefill {self.bootstrap_addr}, not {bootstrap_addr}"
            )
        with self._lock:
            if room in self._rooms:
                raise TransferUsageError(room, "a live receiver exists for this room; clear() it")
            rec = _DecodeRoom(room)
            if self._lost is not None:
                rec.status, rec.reason = KVPoll.FAILED, self._lost
            self._rooms[room] = rec
        if rec.status == KVPoll.FAILED:
            self.ready.put(room)
        return MooncakeKVReceiver(self, rec)

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Tell the prefill's bootstrap endpoint that this side will never send ``room``'s
        destination (:mod:`kv.refusal`; any thread, never blocks)."""
        self._refusals.tell(bootstrap_addr, room, reason)

    def close(self) -> None:
        self._stop.set()
        self._refusals.close()
        self._heartbeat.join(timeout=10)
        self._control.stop()
        with self._push_lock:
            self._push.close()
        self._control.close()

    def _send(self, msg: wire.Message) -> None:
        data = wire.encode(msg, self.config.token)
        with self._push_lock:
            self._push.send(data)

    def _watch_prefill(self) -> None:
        cfg = self.config
        client = BootstrapClient(
            self.bootstrap_addr, timeout_s=min(cfg.heartbeat_interval_s, 3.0), token=cfg.token
        )
        failures = 0
        while not self._stop.wait(cfg.heartbeat_interval_s):
            if client.health():
                failures = 0
                if self.lost is not None:
                    self._reconnect()
                continue
            failures += 1
            if failures == cfg.heartbeat_max_failures:
                self._lose_prefill(
                    f"lost contact with prefill {self.bootstrap_addr}: {failures} health checks "
                    "in a row failed"
                )

    def _lose_prefill(self, reason: str) -> None:
        with self._lock:
            self._lost = reason
            rooms = [*self._rooms.values(), *self._draining.values()]
            self._draining.clear()
            for rec in rooms:
                rec.awaiting_prefill = False  # a prefill that is gone writes nothing more
                if not rec.status.terminal:
                    rec.status, rec.reason = KVPoll.FAILED, reason
        for rec in rooms:
            self.ready.put(rec.room)
        logger.warning("%s; its %d rooms failed", reason, len(rooms))

    def _reconnect(self) -> None:
        """The prefill answers again: look its rank up and register anew."""
        try:
            info = self._lookup(self.bootstrap_addr, self.prefill.rank)
        except MooncakeError as exc:
            logger.warning("prefill %s answers but cannot be used: %s", self.bootstrap_addr, exc)
            return
        with self._push_lock:
            self._push.close()
            self._push = push_socket(self._control.ctx, info.endpoint)
        self.prefill = info
        self._send(self._register)
        with self._lock:
            self._lost = None
        logger.info("prefill %s is back (session %s); registered again", self.bootstrap_addr,
                    info.session)

    def _handle(self, msg: wire.Message) -> None:
        if not isinstance(msg, wire.Status):
            raise wire.WireError("unexpected_type", f"{type(msg).__name__} not for decode")
        self._on_status(msg)

    def _on_status(self, msg: wire.Status) -> None:
        with self._lock:
            rec = self._rooms.get(msg.room)
            if rec is None or not rec.awaiting_prefill:
                rec = self._draining.pop(msg.room, None)
            if rec is None or not rec.awaiting_prefill:
                raise wire.WireError("stale_room", f"status for unknown room {msg.room}")
            rec.awaiting_prefill = False
            if not rec.status.terminal:
                rec.status = KVPoll(msg.poll)
                rec.reason = msg.reason or "prefill reported a failure"
        self.ready.put(msg.room)


class MooncakeKVReceiver:
    """The decode side of one room (see :mod:`kv.transfer` for the contract)."""

    def __init__(self, mgr: MooncakeDecodeManager, rec: _DecodeRoom) -> None:
        self.room = rec.room
        self._mgr = mgr
        self._rec = rec

    def init(self) -> None:
        with self._mgr._lock:
            if self._rec.status == KVPoll.BOOTSTRAPPING:
                self._rec.status = KVPoll.WAITING_FOR_INPUT
        self._mgr.ready.put(self.room)

    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        mgr, rec = self._mgr, self._rec
        if not 0 <= slot < mgr.metadata.num_slots:
            raise TransferUsageError(self.room, f"slot {slot} is not a metadata row")
        arr = np.asarray(pages, dtype=np.int64)
        with mgr._lock:
            if not accepts_call(self.room, rec.status, "send_metadata()"):
                return
            rec.status = KVPoll.TRANSFERRING
            rec.slot = slot
            rec.awaiting_prefill = True
        mgr._send(wire.Destination(self.room, mgr.session, arr, slot))

    def poll(self) -> KVPoll:
        mgr, rec = self._mgr, self._rec
        with mgr._lock:
            if rec.status != KVPoll.SUCCESS or rec.row_landed or self.room == 0:
                return rec.status
            # The metadata gate: the row must carry this room; 0 means it has not landed.
            try:
                landed = mgr.metadata.read(rec.slot, expected_room=self.room)
            except MetadataError as exc:
                rec.status, rec.reason = KVPoll.FAILED, str(exc)
                return rec.status
            if landed is None:
                return KVPoll.TRANSFERRING
            rec.row_landed = True
            return rec.status

    def failure_exception(self) -> TransferError:
        rec = self._rec
        return TransferError.reported(rec.room, rec.status, rec.reason, self._mgr.prefill.session)

    def abort(self) -> None:
        mgr, rec = self._mgr, self._rec
        with mgr._lock:
            if rec.status.terminal:
                return
            rec.status, rec.reason = KVPoll.FAILED, REASON_ABORTED
            tell_prefill = rec.awaiting_prefill
        mgr.ready.put(self.room)
        if tell_prefill:
            mgr._send(wire.Abort(self.room, mgr.session))

    def clear(self) -> None:
        with self._mgr._lock:
            if self._mgr._rooms.get(self.room) is self._rec:
                del self._mgr._rooms[self.room]
                if self._rec.awaiting_prefill:
                    self._mgr._draining[self.room] = self._rec

    def quiescent(self) -> bool:
        """False while prefill may still write into the room's pages (no Status back yet)."""
        with self._mgr._lock:
            return not self._rec.awaiting_prefill
