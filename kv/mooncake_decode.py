"""The decode side of the Mooncake backend: the manager that registers with a prefill server's
ranks, and the per-request receiver (the prefill side is :mod:`kv.mooncake`).

The decode manager is one decode rank (its place: TP rank and size, the model's KV heads; it
holds every layer). It looks the prefill server up at its bootstrap endpoint and refuses one it
cannot pair with (:mod:`kv.mooncake_peers`: another model, page size, KV dtype, pool layout, head
dim, head or layer counts, TP sizes that do not divide), sends every prefill rank one
``Register`` with its engine session, memory layout, model and place, and then per room a
``Watch`` when the receiver is initialised (the request waits for pages from then on), then a
``Destination`` (or an ``Abort``) to the ranks the room's route names (:mod:`kv.routes`: the
contacts of every pipeline stage of the DP replica serving the room); a room it will never ask
for (refused, or failed before its destination) it reports to the prefill's bootstrap endpoint
instead (:meth:`MooncakeDecodeManager.refuse`, :mod:`kv.refusal`). Closing sends every rank a
``Deregister``, so the prefill forgets the session. With state pools
(``states=``, :mod:`kv.mooncake_state`) the ``Register`` names them and each ``Destination`` the
items each state kind goes to; prefill writes the state with the last chunk.

A receiver reports SUCCESS only when every source of every stage (the ranks that write into this
rank) said so in a ``Status`` *and* the metadata row in its slot carries its own room (the
metadata gate). A room whose ``Status`` came before its row (a transport that reports a write
done before its bytes are visible) is polled TRANSFERRING; the control listener looks at its row
on each of its ticks (every 100 ms at least) and pushes the room to ``ready`` again once the row
landed, so the owner polls it then (nothing else would). A FAILED ``Status`` from any contact
fails it with that rank's reason (``REASON_ABORTED`` when prefill aborted the room, a refusal
when prefill refused it), and the contacts that may still hold the room get an ``Abort``, so
every prefill rank fails it and tells this side when it stopped writing. A source's ``Status``
also means it no longer writes the room's pages: :meth:`MooncakeKVReceiver.quiescent` is True
once every source sent one. Before its destination, a FAILED ``Status`` from a rank it watches
(the prefill refused or failed the room: :mod:`kv.mooncake_watch`) fails the receiver at once,
however long the request would still wait for pages; a late one from another watched rank, after
the receiver was cleared, is expected and ignored.

Every ``Abort`` is answered: a prefill rank that had sent the room's ``Status`` already sends it
again, marked ``again`` (the first may have been lost with a connection torn down), so a room whose
``Status`` never came is not held for ever. A repeat is for the use of the room number that sent
that rank an ``Abort`` after its destination and has no ``Status`` from it yet (the oldest: a
cleared one still draining first). An ``Abort`` sent while the destination was still to go out
(from another thread: the heartbeat's, a client's abort) may reach the rank first and be answered
with an earlier use's ``Status`` again, and the destination then be attached and written into: that
use takes no repeat, and waits for its own ``Status`` (one socket per rank, so an ``Abort`` sent
once the destination's send returned follows it); one that repeats a ``Status`` that came (the
``Abort`` crossed it: noted when it came) is dropped, as ``stale_room``, even where a later use of
the room number now waits for that rank, and so is one for a room no longer held. A rank's statuses
come in order, so a repeat for an earlier use comes before any ``Status`` of a later one. The one
case this cannot tell apart: a rank whose ``Status`` answered an ``Abort`` of a live room (no
repeat follows), then a later use whose own ``Status`` is lost too: that use's repeat is taken for
the earlier use's and dropped, and the later use stays held as before (a leak, not pages freed
early). The notes of statuses that came after their use's ``Abort`` are bounded (the oldest of 4096
goes first): a repeat that comes after its note went is taken as any other.

Heartbeat (as SGLang's decode side): a thread checks the prefill bootstrap's ``/health`` every
``heartbeat_interval_s`` (naming this rank's engine session: a prefill shutting down waits for
the ranks that hold its rooms to read that it stopped writing) and, while it answers, sends
every prefill rank the ``Register`` again (the keepalive: a prefill rank forgets a decode
session silent for several intervals, so a decode rank killed without its ``Deregister`` does
not stay registered for ever). After
``heartbeat_max_failures`` failures in a row the prefill counts as gone: every room not yet
concluded fails with a reason naming it, and receivers created meanwhile fail at once and wake
the heartbeat for a check of its own (a request is the first sign that a restarted prefill is
back). A failed health check does not show that the prefill ranks stopped: its bootstrap
endpoint may be unreachable (a blip, its connection cap) while they still write. So each failed
room's contacts are sent an ``Abort`` (the control sockets may still reach them), and a room a
source may still write into stays held (not quiescent, its pages reserved) until that source's
``Status`` comes, until the prefill is known gone for good (its bootstrap endpoint answers as
another instance: the process that held the room is no more; or answers that its ranks stopped
writing KV, :meth:`kv.bootstrap.BootstrapServer.mark_unhealthy`), or until
``config.lost_release_timeout_s`` passed (the backstop: a prefill that neither answers nor
stopped could still write into pages given back). A health check answered by another instance
of the bootstrap endpoint (``X-Pdlife-Instance``: a prefill restarted between two checks, too
fast to miss any) counts as gone and back at once, its rooms quiescent at once; one that
answers that the ranks stopped writing counts as gone at once, its rooms quiescent at once, and
the prefill is not registered with again until another instance answers. When the health check
answers ``OK`` again, the manager looks the prefill server up again, sends every rank a fresh
``Register``, so a restarted prefill server is used without restarting decode, sends the same
instance an ``Abort`` again for each room still held (the first may have been lost with the
connection), and refuses to it the rooms it failed when it lost the prefill and those it failed
at once meanwhile (the router may have sent their other half there: without the refusal it would
wait for its bootstrap timeout). A prefill that answers again but cannot be used (restarted with
another page size, model or layout: the look-up refuses it) still counts as gone, now with the
look-up's reason: the rooms failed meanwhile are refused to it at once, a receiver created from
then on fails with that reason and wakes the heartbeat, whose check refuses its room too, and
that instance is not looked up again (another instance at the address is).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from kv import wire
from kv.bootstrap import BootstrapClient, PrefillStopped
from kv.metadata import MetadataBuffers, MetadataError
from kv.mooncake_engine import (
    ControlEndpoint,
    IncompatiblePeerError,
    MooncakeConfig,
    MooncakeError,
    PeerAuthError,
    kv_dtype_name,
)
from kv.mooncake_peers import PrefillPeers, decode_rank, lookup_prefill
from kv.mooncake_state import pool_memory
from kv.pool import KVPool
from kv.rank_table import PrefillInfo, RankPlace
from kv.refusal import RefusalPoster
from kv.routes import IncompatibleRanksError
from kv.state_copy import check_state
from kv.state_pools import StateKind, StatePools
from kv.state_routes import state_sources
from kv.transfer import REASON_ABORTED, KVPoll, TransferError, TransferUsageError, accepts_call

logger = logging.getLogger(__name__)

#: The most rooms failed while the prefill counted as gone that are refused to it when it is
#: back (the newest; older ones have timed out there).
_MAX_REFUSED_WHILE_LOST = 4096
#: The most cleared rooms whose watched ranks may still send their failure (the newest).
_MAX_CLEARED_WATCHES = 4096
#: The most (room, prefill rank) pairs remembered whose repeated ``Status`` may still come for
#: a use of the room that is done with the rank (the newest).
_MAX_REPEATS_DUE = 4096


@attrs.define(eq=False)
class _DecodeRoom:
    room: int
    status: KVPoll = KVPoll.BOOTSTRAPPING
    reason: str = ""
    peer: str = ""  # who reported the failure
    slot: int = -1
    # The prefill ranks given the destination, and those of them that write into this rank.
    contacts: tuple[int, ...] = ()
    sources: tuple[int, ...] = ()
    # Sources whose SUCCESS has not come yet.
    waiting: set[int] = attrs.Factory(set)
    # Sources with no Status back yet: they may still write into the pages.
    awaiting: set[int] = attrs.Factory(set)
    row_landed: bool = False
    # The prefill ranks sent a Watch that may still answer it with a failure (none once the
    # destination went out: from then on the contacts answer).
    watched: set[int] = attrs.Factory(set)
    # Set when the prefill counted as gone while sources of the room had sent no Status: when
    # (time.monotonic()) the room stops waiting for them and is quiescent.
    held_until: float | None = None
    # The prefill ranks sent an Abort of this use of the room: each answers it, with the
    # room's Status again (marked ``again``) where it had sent that one already.
    aborted: set[int] = attrs.Factory(set)
    # The contacts this use's destination was sent to (set once the send returned), and those
    # it sent an Abort before that: such an Abort may reach the rank ahead of the destination
    # and be answered with an earlier use's Status again, never this use's.
    dest_sent: set[int] = attrs.Factory(set)
    aborted_first: set[int] = attrs.Factory(set)

    def note_aborted(self, ranks: Iterable[int]) -> None:
        """This use sends ``ranks`` an ``Abort`` (called with the manager's lock held)."""
        given = set(ranks)
        self.aborted |= given
        self.aborted_first |= given - self.dest_sent

    def unreported(self) -> list[int]:
        """The contacts that may still hold the room: sources with no Status back, and the
        status-only ranks (which report only a failure)."""
        return [r for r in self.contacts if r in self.awaiting or r not in self.sources]


class MooncakeDecodeManager:
    """Decode side: engine, status listener, a registration with every prefill rank (naming
    the pools of ``states``, a hybrid model's, where prefill writes their state too)."""

    def __init__(
        self,
        pool: KVPool,
        metadata: MetadataBuffers,
        bootstrap_addr: str,
        *,
        place: RankPlace | None = None,
        config: MooncakeConfig | None = None,
        states: StatePools | None = None,
        closing: threading.Event | None = None,
    ) -> None:
        """Looks the prefill server up first, for up to ``config.connect_timeout_s``, or until
        ``closing`` (its owner's, set when the owner closes) is set. A room failed because the
        prefill counted as gone stays held for at most ``config.lost_release_timeout_s`` while
        a prefill rank may still write into it (see the module)."""
        if states is not None and states.full is not pool:
            raise ValueError("the state pools' full pool must be the manager's KV pool")
        self.config = config or MooncakeConfig()
        self._release_after = float(self.config.lost_release_timeout_s)
        self.pool = pool
        self.states = states
        self.metadata = metadata
        self.bootstrap_addr = bootstrap_addr
        self.place = place or RankPlace.single(num_layers=pool.num_layers, kv_heads=pool.kv_heads)
        self._me = decode_rank(pool, self.place)
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._wake = threading.Event()  # check the prefill's health now (or stop)
        self._refusals = RefusalPoster(token=self.config.token)
        self._lock = threading.Lock()
        self._rooms: dict[int, _DecodeRoom] = {}
        # Cleared rooms whose sources have not all sent their Status ("no more writes") yet.
        self._draining: dict[int, _DecodeRoom] = {}
        # Cleared rooms whose watched ranks may still send the failure, and which ranks.
        self._cleared_watches: OrderedDict[int, set[int]] = OrderedDict()
        # The (room, prefill rank) pairs that may still send a repeated Status (``again``) for
        # a use of the room done with that rank: it was sent an Abort, then the room's Status
        # came (which the Abort may have crossed). Not for a later use of the room number.
        self._repeats_due: OrderedDict[tuple[int, int], None] = OrderedDict()
        # Rooms whose SUCCESS waits for their metadata row (the gate), pushed when it lands.
        self._gated: dict[int, _DecodeRoom] = {}
        # The earliest held_until of the rooms held for a lost prefill, or None.
        self._release_due: float | None = None
        table = lookup_prefill(bootstrap_addr, self.config, self._me, closing or self._stop)
        self._control = ControlEndpoint(
            self.config, pool, metadata, self._handle, name="mooncake-status", log=logger,
            states=states, tick=self._tick,
        )
        try:
            self._open(table)
        except BaseException:
            self._abandon()
            raise

    def _open(self, table: PrefillInfo) -> None:
        """The rest of the construction, once the control endpoint exists: the sockets to the
        prefill ranks, the ``Register``, the listener and the heartbeat."""
        pool, metadata, states = self.pool, self.metadata, self.states
        self.session = self._control.session  # its engine's host:rpc_port
        self.dropped_messages = self._control.dropped_messages
        self._peers = PrefillPeers(self._control.ctx, table, self._me, self.config.token)
        # Why the prefill counts as gone (see the heartbeat) and since when (monotonic), or
        # None while it answers.
        self._lost: str | None = None
        self._lost_since: float | None = None
        # Rooms failed when the prefill was lost and at once meanwhile, with why: refused to
        # the prefill when it is back.
        self._failed_while_lost: deque[tuple[int, str]] = deque(maxlen=_MAX_REFUSED_WHILE_LOST)
        # The prefill instance that refused this rank's Register (wire.Refused), while it
        # counts as gone for that reason.
        self._refused_by: str | None = None
        self._closed = False
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
            kv_heads=self.place.kv_heads,
            head_dim=pool.head_dim,
            mla=self.place.mla,
            tp_rank=self.place.tp_rank,
            tp_size=self.place.tp_size,
            state_pools=pool_memory(states),
            state_window=0 if states is None or states.window is None else states.window,
            keepalive_ms=self._keepalive_ms(table),
        )
        self._peers.send_all(self._register)
        # The status socket is bound, so nothing sent to it is lost before its thread runs.
        self._control.start()
        self._heartbeat = threading.Thread(
            target=self._watch_prefill, name="mooncake-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def _abandon(self) -> None:
        """Undo a construction that failed once the control endpoint existed, in reverse order
        (nothing that started may outlive it: an open socket left in the context blocks the
        context's termination, which the garbage collector attempts, for ever). The heartbeat
        never started (it starts last); the listener stops if it started, then every socket
        of the context closes, those of a :class:`PrefillPeers` that failed half-way included,
        then the context and the engine."""
        self._stop.set()
        self._control.stop()
        self._control.ctx.destroy(linger=0)
        self._control.close()
        self._refusals.close()

    @property
    def prefill(self) -> PrefillInfo:
        """The prefill server's table, as last looked up."""
        return self._peers.table

    @property
    def lost(self) -> str | None:
        """Why the prefill counts as gone, or None while its health check answers."""
        with self._lock:
            return self._lost

    def refuse_while_lost(self, room: int) -> str | None:
        """Why the prefill counts as gone, or None. When it does, ``room`` (a request failed
        before it reached this manager) is refused to the prefill once it answers again, as
        a receiver's room is, and the prefill is checked now."""
        with self._lock:
            if self._lost is None:
                return None
            self._failed_while_lost.append((room, self._lost))
            self._wake.set()
            return self._lost

    @property
    def lost_since(self) -> float | None:
        """When (``time.monotonic()``) the prefill came to count as gone, or None while its
        health check answers."""
        with self._lock:
            return self._lost_since

    def create_receiver(self, bootstrap_addr: str, room: int) -> MooncakeKVReceiver:
        if bootstrap_addr != self.bootstrap_addr:
            raise TransferUsageError(
                room, f"this manager serves prefill {self.bootstrap_addr}, not {bootstrap_addr}"
            )
        with self._lock:
            if room in self._rooms:
                raise TransferUsageError(room, "a live receiver exists for this room; clear() it")
            rec = _DecodeRoom(room)
            if self._closed:
                rec.status, rec.reason = KVPoll.FAILED, "the decode manager closed"
            elif self._lost is not None:
                rec.status, rec.reason = KVPoll.FAILED, self._lost
                self._failed_while_lost.append((room, self._lost))
                self._wake.set()
            self._rooms[room] = rec
        if rec.status == KVPoll.FAILED:
            self.ready.put(room)
        return MooncakeKVReceiver(self, rec)

    def live_rooms(self) -> int:
        """Rooms with a receiver, and cleared rooms a prefill rank may still write into."""
        with self._lock:
            return len(self._rooms) + len(self._draining)

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Tell the prefill's bootstrap endpoint that this side will never send ``room``'s
        destination (:mod:`kv.refusal`; any thread, never blocks)."""
        self._refusals.tell(bootstrap_addr, room, reason)

    def close(self) -> None:
        """Stop; every prefill rank still answering is sent a ``Deregister``, so it forgets
        this session (its rooms with this rank fail there) and closes its status socket. The
        rooms still live here fail (quiescent: the engine is gone), and so does a receiver
        created after."""
        self._stop.set()
        self._wake.set()
        self._refusals.close()
        self._heartbeat.join(timeout=10)
        self._control.stop()
        with self._lock:
            farewell = None if self._lost is not None else wire.Deregister(self.session)
        self._peers.close(farewell)
        self._control.close()
        # The engine and its registrations are gone: nothing lands and no status comes any
        # more, so the rooms still live fail now rather than at their owner's timeout.
        with self._lock:
            self._closed = True
            rooms = self._end_rooms("the decode manager closed")
        for rec in rooms:
            self.ready.put(rec.room)

    def _keepalive_ms(self, table: PrefillInfo) -> int:
        """How often the ``Register`` goes again to the ranks of ``table``: every heartbeat,
        where the server takes keepalives (an older one refuses the field: never)."""
        return round(self.config.heartbeat_interval_s * 1000) if table.keepalive else 0

    def _watch_prefill(self) -> None:
        cfg = self.config
        client = BootstrapClient(
            self.bootstrap_addr, timeout_s=min(cfg.heartbeat_interval_s, 3.0), token=cfg.token,
            session=self.session,  # so a prefill shutting down knows this rank read it
        )
        failures = 0
        while True:
            self._wake.wait(cfg.heartbeat_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                answered = self._check_prefill(client)
            except Exception:  # the heartbeat must outlive any one check: it is the way back
                logger.exception("health check of prefill %s failed", self.bootstrap_addr)
                answered = False
            if answered:
                failures = 0
                continue
            failures += 1
            if failures == cfg.heartbeat_max_failures:
                self._lose_prefill(
                    f"lost contact with prefill {self.bootstrap_addr}: {failures} health checks "
                    "in a row failed"
                )

    def _check_prefill(self, client: BootstrapClient) -> bool:
        """One health check; whether the prefill answered. A prefill that answers again, or
        as another instance, is registered with anew; one that answers as before gets the
        keepalive. One that answers that it stopped writing KV (it shut down, or its engine failed
        and its writes ended) counts as gone for good: its rooms are quiescent at once."""
        try:
            instance = client.instance()
        except PrefillStopped as stopped:
            self._prefill_stopped(stopped.reason)
            return True
        if instance is None:
            return False
        known = self._peers.table.instance
        if instance and known and instance != known:
            # Restarted: its ranks, engines and rooms are new, and the process that held this
            # side's rooms writes nothing more.
            restarted = (f"prefill {self.bootstrap_addr} restarted (another instance answers "
                         "its bootstrap endpoint)")
            if self.lost is None:  # between two checks
                self._lose_prefill(restarted, gone=True)
            else:
                self._release_held(restarted)
        with self._lock:
            refused = self._refused_by is not None and instance == self._refused_by
        if refused:  # the same prefill instance: it still cannot pair
            self._refuse_failed()
        elif self.lost is not None:
            self._reconnect(instance)
        elif self._register.keepalive_ms:  # a prefill rank forgets a silent session
            self._peers.send_all(self._register)
        return True

    def _prefill_stopped(self, why: str) -> None:
        """The prefill's bootstrap endpoint answers that its ranks write no KV any more
        (``why``, its reason: :meth:`kv.bootstrap.BootstrapServer.mark_unhealthy`): no room
        waits for their ``Status`` any more, as for a prefill restarted. It is not registered
        with again until another instance answers."""
        stopped = (f"lost contact with prefill {self.bootstrap_addr}: it stopped writing KV "
                   f"(its bootstrap endpoint answers unhealthy: {why!r})")
        if self.lost is None:
            self._lose_prefill(stopped, gone=True)
        else:
            self._release_held(stopped)

    def _lose_prefill(self, reason: str, level: int = logging.WARNING, *,
                      gone: bool = False) -> None:
        """The prefill counts as gone, for ``reason``: every room not concluded fails. With
        ``gone`` (the process that held the rooms is no more) every room is quiescent at once;
        otherwise its ranks may still be alive and writing: each failed room's contacts are
        sent an ``Abort``, and a room whose sources did not all send their ``Status`` stays
        held until they do, the prefill is known gone, or ``lost_release_timeout_s`` passed."""
        with self._lock:
            self._lost, self._lost_since = reason, time.monotonic()
            # Their other halves may wait on the prefill (one restarted took them after its
            # restart, a prefill cut off by the network still holds them): refused to it once
            # it answers again.
            self._failed_while_lost.extend((room, reason) for room, rec in self._rooms.items()
                                           if not rec.status.terminal)
            tell: list[tuple[int, list[int]]] = []
            if gone:
                rooms = self._end_rooms(reason)
            else:
                rooms, tell = self._hold_rooms(reason, time.monotonic() + self._release_after)
            held = len(self._held())
        for rec in rooms:
            self.ready.put(rec.room)
        self._abort(tell)
        logger.log(level, "%s; its %d rooms failed%s", reason, len(rooms),
                   f" ({held} held until their prefill ranks answer, at most "
                   f"{self._release_after:g} s)" if held else "")

    def _end_rooms(self, reason: str) -> list[_DecodeRoom]:
        """Fail every room not concluded with ``reason`` and make every room quiescent: no
        write lands any more (the prefill is gone, or this engine is). The rooms, whose owners
        must hear of it. Called with ``self._lock`` held."""
        rooms = [*self._rooms.values(), *self._draining.values()]
        self._draining.clear()
        for rec in rooms:
            rec.awaiting.clear()
            rec.watched.clear()
            rec.held_until = None
            if not rec.status.terminal:
                rec.status, rec.reason = KVPoll.FAILED, reason
        self._release_due = None
        return rooms

    def _hold_rooms(self, reason: str, until: float
                    ) -> tuple[list[_DecodeRoom], list[tuple[int, list[int]]]]:
        """Fail every room not concluded with ``reason``; a room whose sources may still write
        stays held until they answer or ``until``. The rooms, whose owners must hear of it,
        and the contacts to send an ``Abort``, by room: those of every room failed now, and of
        every room still held. Called with ``self._lock`` held."""
        rooms = [*self._rooms.values(), *self._draining.values()]
        tell: list[tuple[int, list[int]]] = []
        for rec in rooms:
            rec.watched.clear()  # a watched rank has no destination: it writes nothing
            failed_now = not rec.status.terminal
            if failed_now:
                rec.status, rec.reason = KVPoll.FAILED, reason
            if rec.awaiting:
                rec.held_until = until if rec.held_until is None else min(rec.held_until, until)
                due = self._release_due
                self._release_due = rec.held_until if due is None else min(due, rec.held_until)
            contacts = rec.unreported()
            if contacts and (failed_now or rec.awaiting):
                tell.append((rec.room, contacts))
                rec.note_aborted(contacts)
        return rooms, tell

    def _held(self) -> list[_DecodeRoom]:
        """The rooms held for a lost prefill. Called with ``self._lock`` held."""
        return [rec for rec in (*self._rooms.values(), *self._draining.values())
                if rec.held_until is not None and rec.awaiting]

    def _let_go(self, rec: _DecodeRoom) -> None:
        """``rec`` waits for no prefill rank any more: quiescent. Called with ``self._lock``
        held."""
        rec.awaiting.clear()
        rec.held_until = None
        if self._draining.get(rec.room) is rec:
            del self._draining[rec.room]

    def _release_held(self, why: str) -> None:
        """The prefill that held the rooms still held is known gone (``why``): they are
        quiescent now."""
        with self._lock:
            held = self._held()
            for rec in held:
                self._let_go(rec)
            self._release_due = None
        for rec in held:
            self.ready.put(rec.room)
        if held:
            logger.info("%s: the %d rooms held for it are released", why, len(held))

    def _release_overdue(self, now: float | None = None) -> list[int]:
        """Release the rooms held for a lost prefill longer than ``lost_release_timeout_s``
        (``now``: ``time.monotonic()`` by default; the control listener calls this on its ticks
        once one is due); the rooms released."""
        now = time.monotonic() if now is None else now
        with self._lock:
            held = self._held()
            overdue = [rec for rec in held if rec.held_until is not None
                       and rec.held_until <= now]
            for rec in overdue:
                self._let_go(rec)
            self._release_due = min((rec.held_until for rec in held if rec.held_until
                                     is not None and rec.held_until > now), default=None)
        for rec in overdue:
            self.ready.put(rec.room)
        if overdue:
            rooms = sorted({rec.room for rec in overdue})
            named = ", ".join(map(str, rooms[:8])) + (f" and {len(rooms) - 8} more"
                                                      if len(rooms) > 8 else "")
            logger.warning(
                "prefill %s sent no Status for %d rooms (%s) within %g s of counting as gone: "
                "their pages go back (a prefill rank cut off but still writing would write "
                "into them)", self.bootstrap_addr, len(rooms), named, self._release_after)
        return [rec.room for rec in overdue]

    def _abort(self, tell: list[tuple[int, list[int]]]) -> None:
        """Send each room's ``Abort`` to its contacts named in ``tell``."""
        for room, ranks in tell:
            self._peers.send(ranks, wire.Abort(room, self.session))

    def _tick(self) -> None:
        """The control listener's periodic work: push the gated rooms whose row landed, and
        release the held rooms that are overdue."""
        with self._lock:
            landed = [room for room, rec in self._gated.items() if self._row_landed(rec)]
            for room in landed:
                del self._gated[room]
            due = self._release_due
        for room in landed:
            self.ready.put(room)
        if due is not None and time.monotonic() >= due:
            self._release_overdue()

    def _row_landed(self, rec: _DecodeRoom) -> bool:
        """Whether the metadata row in ``rec``'s slot has landed (with its room or, stale or
        corrupt, another: its poll says which). Called with ``self._lock`` held."""
        try:
            return self.metadata.read(rec.slot, expected_room=rec.room) is not None
        except MetadataError:
            return True

    def _reconnect(self, instance: str) -> None:
        """The prefill (``instance`` of it) answers again: look its ranks up and register
        anew. One that answers but cannot be used still counts as gone, now for that reason:
        the rooms failed meanwhile are refused to it (their halves wait there), and so is each
        room created from now on, at the next check, which it wakes; one that cannot pair
        (another page size, model, layout, peer token) is looked up again only once another
        instance of it answers."""
        try:
            table = lookup_prefill(self.bootstrap_addr, self.config, self._me, self._stop)
        except MooncakeError as exc:
            if self._stop.is_set():  # the look-up stopped: this manager is closing
                return
            reason = f"prefill {self.bootstrap_addr} answers but cannot be used: {exc}"
            logger.warning("%s", reason)
            with self._lock:
                self._lost = reason
                if isinstance(exc, IncompatiblePeerError | PeerAuthError):
                    self._refused_by = instance or None
            self._refuse_failed()
            return
        peers = PrefillPeers(self._control.ctx, table, self._me, self.config.token)
        old, self._peers = self._peers, peers
        old.close()
        self._register = attrs.evolve(self._register, keepalive_ms=self._keepalive_ms(table))
        peers.send_all(self._register)
        with self._lock:
            self._lost = self._lost_since = self._refused_by = None
            # The same instance is back (another one released them): the Abort sent when it
            # was lost may not have reached it.
            held = self._held()
            tell = [(rec.room, rec.unreported()) for rec in held]
            for rec in held:
                rec.note_aborted(rec.unreported())
        self._abort(tell)
        failed = self._refuse_failed()
        logger.info("prefill %s is back (%d ranks); registered again%s", self.bootstrap_addr,
                    len(table.ranks), f", refused the {len(failed)} rooms failed since it was lost"
                    if failed else "")

    def _handle(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.Status):
            self._on_status(msg)
        elif isinstance(msg, wire.Refused):
            self._on_refused(msg)
        else:
            raise wire.WireError("unexpected_type", f"{type(msg).__name__} not for decode")

    def _on_refused(self, msg: wire.Refused) -> None:
        """A prefill rank cannot pair with this decode rank (another model, another pool or
        metadata layout): the prefill counts as gone until another instance of it answers
        its bootstrap endpoint, and the rooms failed meanwhile are refused to it at once."""
        table = self._peers.table
        if all(r.rank != msg.rank for r in table.ranks):
            raise wire.WireError("not_a_contact", f"refusal from rank {msg.rank}, which the "
                                 f"table of prefill {self.bootstrap_addr} does not hold")
        with self._lock:
            if self._lost is not None:
                return  # already gone (the rank's refusal of a keepalive, or another rank's)
            self._refused_by = table.instance or None
        self._lose_prefill(f"prefill {self.bootstrap_addr} (rank {msg.rank}) cannot pair with "
                           f"this decode rank: {msg.reason}", level=logging.ERROR)
        self._refuse_failed()

    def _refuse_failed(self) -> list[tuple[int, str]]:
        """Refuse to the prefill the rooms failed since it counted as gone (their other halves
        wait there); those rooms, with why."""
        with self._lock:
            failed = list(self._failed_while_lost)
            self._failed_while_lost.clear()
        for room, reason in failed:
            self.refuse(self.bootstrap_addr, room, reason)
        return failed

    def _on_status(self, msg: wire.Status) -> None:
        """A prefill rank concluded its side: a source's SUCCESS counts towards the room's, a
        FAILED from any contact fails it, and the contacts that may still hold the room are
        told to abort, so every prefill rank fails it. A repeated one (``again``) is for the
        use of the room :meth:`_repeated` names."""
        rank = msg.rank
        with self._lock:
            if msg.again:
                rec = self._repeated(msg)
            elif self._on_watched(msg):
                return
            else:
                rec = self._first(msg)
                self._note_repeat(rec, rank)
            rec.awaiting.discard(rank)
            if not rec.awaiting:
                rec.held_until = None
                if self._draining.get(msg.room) is rec:
                    del self._draining[msg.room]
            abort: list[int] = []
            if msg.poll == KVPoll.FAILED and not rec.status.terminal:
                rec.status = KVPoll.FAILED
                rec.reason = msg.reason or "prefill reported a failure"
                rec.peer = self._peers.session(rank)
                abort = [r for r in rec.unreported() if r != rank]
                rec.note_aborted(abort)
            elif msg.poll == KVPoll.SUCCESS and rank in rec.waiting:
                rec.waiting.discard(rank)
                if not rec.waiting and not rec.status.terminal:
                    rec.status = KVPoll.SUCCESS
        self.ready.put(msg.room)
        if abort:
            self._peers.send(abort, wire.Abort(msg.room, self.session))

    def _first(self, msg: wire.Status) -> _DecodeRoom:
        """The use of the room a rank's own ``Status`` is for: the one holding the room that
        waits for it, else the cleared one that does, else the one holding the room that has
        the rank among its contacts. Raises ``stale_room`` for none. Called with
        ``self._lock`` held."""
        rank = msg.rank
        rec = self._rooms.get(msg.room)
        if rec is None or rank not in rec.awaiting:
            rec = self._draining.get(msg.room)
            if rec is None or rank not in rec.awaiting:
                rec = self._rooms.get(msg.room)
        if rec is None or rank not in rec.contacts:
            raise wire.WireError("stale_room", f"status for unknown room {msg.room}")
        return rec

    def _note_repeat(self, rec: _DecodeRoom, rank: int) -> None:
        """``rank``'s own ``Status`` of ``rec``'s room came: where ``rec`` had sent it an
        ``Abort``, which may have crossed that ``Status``, a repeat of it may follow, and is
        that use's; otherwise any repeat for an earlier use came before it (a rank's statuses
        come in order) or never will. Called with ``self._lock`` held."""
        key = (rec.room, rank)
        if rank in rec.aborted:
            self._repeats_due[key] = None
            self._repeats_due.move_to_end(key)
            while len(self._repeats_due) > _MAX_REPEATS_DUE:
                self._repeats_due.popitem(last=False)
        else:
            self._repeats_due.pop(key, None)

    def _repeated(self, msg: wire.Status) -> _DecodeRoom:
        """The use of the room that a repeated ``Status`` (``again``: a prefill rank answering
        an ``Abort`` that came after the room's ``Status``, which may have been lost) is for:
        the oldest that sent the rank an ``Abort`` and has no ``Status`` from it yet. Raises
        ``stale_room`` for one that repeats what came already (a use done with the rank, the
        room number perhaps held anew meanwhile: the repeat is not the new use's), or for a
        room no longer held. Called with ``self._lock`` held."""
        key = (msg.room, msg.rank)
        if key in self._repeats_due:
            del self._repeats_due[key]
            raise wire.WireError("stale_room", f"repeated status for room {msg.room} from "
                                               f"rank {msg.rank}: its first came")
        for rec in (self._draining.get(msg.room), self._rooms.get(msg.room)):
            if (rec is not None and msg.rank in rec.aborted and msg.rank in rec.awaiting
                    and msg.rank not in rec.aborted_first):
                return rec
        raise wire.WireError("stale_room", f"repeated status for room {msg.room} from rank "
                                           f"{msg.rank}, which no use of it waits for")

    def _on_watched(self, msg: wire.Status) -> bool:
        """A failure from a rank this side watches the room of, before its destination: the
        room fails (none of the prefill ranks will serve it). Whether ``msg`` was one; called
        with ``self._lock`` held."""
        if msg.poll != KVPoll.FAILED:
            return False
        # An earlier use of the room number comes first (a rank's statuses come in order): the
        # status its destination is owed, then the failure owed to its watch.
        old = self._draining.get(msg.room)
        if old is not None and msg.rank in old.awaiting:
            return False
        late = self._cleared_watches.get(msg.room)
        if late is not None and msg.rank in late:
            late.discard(msg.rank)
            if not late:
                del self._cleared_watches[msg.room]
            return True
        rec = self._rooms.get(msg.room)
        if rec is None or msg.rank not in rec.watched:
            return False
        rec.watched.discard(msg.rank)
        if not rec.status.terminal:
            rec.status = KVPoll.FAILED
            rec.reason = msg.reason or "prefill reported a failure"
            rec.peer = self._peers.session(msg.rank)
        self.ready.put(msg.room)
        return True

    def _watch(self, rec: _DecodeRoom) -> None:
        """Ask the ranks of ``rec``'s route to tell this side at once if they fail the room
        before its destination (a prefill server that predates watches is not asked)."""
        if not self._peers.table.watch:
            return
        try:
            ranks = {r.rank for r in self._peers.route(rec.room).contacts}
        except IncompatibleRanksError:
            return  # send_metadata fails the room
        with self._lock:
            if rec.status.terminal or rec.contacts:
                return
            rec.watched = ranks
        self._peers.send(sorted(ranks), wire.Watch(rec.room, self.session))


class MooncakeKVReceiver:
    """The decode side of one room (see :mod:`kv.transfer` for the contract)."""

    def __init__(self, mgr: MooncakeDecodeManager, rec: _DecodeRoom) -> None:
        self.room = rec.room
        self._mgr = mgr
        self._rec = rec

    def init(self) -> None:
        with self._mgr._lock:
            started = self._rec.status == KVPoll.BOOTSTRAPPING
            if started:
                self._rec.status = KVPoll.WAITING_FOR_INPUT
        if started:
            self._mgr._watch(self._rec)
        self._mgr.ready.put(self.room)

    def send_metadata(self, pages: Sequence[int], slot: int,
                      state: Mapping[StateKind, Sequence[int]] | None = None) -> None:
        """Give the destination to every prefill rank of the room's route: ``pages``,
        ``slot`` and, with state pools, where each kind of ``state`` goes (the draft pool's
        pages are ``pages``)."""
        mgr, rec = self._mgr, self._rec
        if not 0 <= slot < mgr.metadata.num_slots:
            raise TransferUsageError(self.room, f"slot {slot} is not a metadata row")
        items = {StateKind(kind): [int(i) for i in v] for kind, v in (state or {}).items()}
        why = check_state(mgr.states, items, "decode")
        if why:
            raise TransferUsageError(self.room, why)
        arr = np.asarray(pages, dtype=np.int64)
        try:
            route = mgr._peers.route(self.room)
        except IncompatibleRanksError as exc:
            with mgr._lock:
                if accepts_call(self.room, rec.status, "send_metadata()"):
                    rec.status, rec.reason = KVPoll.FAILED, str(exc)
            mgr.ready.put(self.room)
            return
        with mgr._lock:
            if not accepts_call(self.room, rec.status, "send_metadata()"):
                return
            rec.status = KVPoll.TRANSFERRING
            rec.slot = slot
            rec.watched = set()
            rec.contacts = tuple(r.rank for r in route.contacts)
            wanted = state_sources(route.plan, mgr.place.tp_rank,
                                   {} if mgr.states is None else mgr.states.shapes())
            rec.sources = tuple(r.rank for s in route.stages for r in s.contacts
                                if r.place.tp_rank in wanted)
            rec.waiting = set(rec.sources)
            rec.awaiting = set(rec.sources)
        where = {str(kind): np.asarray(v, dtype=np.int64) for kind, v in items.items()}
        mgr._peers.send(rec.contacts,
                        wire.Destination(self.room, mgr.session, arr, slot, state=where))
        with mgr._lock:  # an Abort sent from now on follows it on each rank's socket
            rec.dest_sent.update(rec.contacts)

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
                mgr._gated[self.room] = rec  # pushed again when the row lands
                return KVPoll.TRANSFERRING
            rec.row_landed = True
            return rec.status

    def failure_exception(self) -> TransferError:
        rec = self._rec
        return TransferError.reported(rec.room, rec.status, rec.reason,
                                      rec.peer or self._mgr.bootstrap_addr)

    def abort(self) -> None:
        mgr, rec = self._mgr, self._rec
        with mgr._lock:
            if rec.status.terminal:
                return
            rec.status, rec.reason = KVPoll.FAILED, REASON_ABORTED
            tell = rec.unreported()
            rec.note_aborted(tell)
        mgr.ready.put(self.room)
        if tell:
            mgr._peers.send(tell, wire.Abort(self.room, mgr.session))

    def clear(self) -> None:
        mgr = self._mgr
        with mgr._lock:
            if mgr._rooms.get(self.room) is self._rec:
                del mgr._rooms[self.room]
                mgr._gated.pop(self.room, None)
                if self._rec.awaiting:
                    mgr._draining[self.room] = self._rec
                if self._rec.watched:
                    mgr._cleared_watches[self.room] = self._rec.watched
                    while len(mgr._cleared_watches) > _MAX_CLEARED_WATCHES:
                        mgr._cleared_watches.popitem(last=False)

    def quiescent(self) -> bool:
        """False while a prefill rank may still write into the room's pages (a source sent no
        Status back yet, and neither is its prefill known gone nor did the bound for a lost
        one pass)."""
        with self._mgr._lock:
            return not self._rec.awaiting
