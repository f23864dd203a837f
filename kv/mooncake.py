"""The prefill side of the Mooncake transfer backend: the manager and the per-room sender.

Theory of operation
-------------------
Both sides own a Mooncake ``TransferEngine`` (:mod:`kv.mooncake_engine`; handshake
``P2PHANDSHAKE``, TCP here, RDMA where configured) with their KV pool tensor and metadata buffers
registered. The prefill side only ever *writes* into decode memory; decode never reads prefill
memory. The decode side is :mod:`kv.mooncake_decode`.

Control messages (:mod:`kv.wire`) travel over ZeroMQ PUSH → PULL. Decode looks the prefill rank
up at the bootstrap endpoint (:mod:`kv.bootstrap`), refuses one that serves another model
(:mod:`kv.model_id`) or whose page size, KV dtype or pool layout (:mod:`kv.pool_layout`)
differs, and sends one ``Register`` with its session, memory layout and model (prefill checks
them too); then, per room, a
``Watch`` while it has no pages for the room yet, a ``Destination`` (pages and metadata slot)
or an ``Abort``. The prefill listener thread validates
every message and drops (logs, counts) bad ones; it never dies of one.

The prefill side has three parts. :class:`~kv.mooncake_rooms.PrefillRooms` owns every room's
state (BOOTSTRAPPING → WAITING_FOR_INPUT → TRANSFERRING → SUCCESS / FAILED), the known decode
sessions, early destinations and the answers each session had; it does no I/O. The write pipeline
(:mod:`kv.mooncake_writes`) turns queued chunks into engine writes on its worker threads. The
manager here wires them to the engine and the sockets: it runs the listener, registers decode
sessions, and pushes the ``Status`` messages the room table says decode is owed. A
:class:`MooncakeKVSender` is a thin handle on one room of the table.

Failure: a non-zero engine return fails the room with a reason naming the decode session and
blacklists the session: its other live rooms fail at once (they cannot succeed) and later chunks
to it are skipped, while other sessions are untouched. A ``Register`` from the session, its
keepalive included, clears the blacklist. A dead decode peer fails within about a second (TCP
connection refused). A decode session silent for longer than its keepalive allows (killed: it
sent no ``Deregister``) is forgotten as if it had deregistered (:meth:`forget_silent`, from
the listener thread once a second, and only once it has read every message waiting: a
listener that did not run for a while judges no one before it caught up with the keepalives
queued meanwhile); the statuses its rooms are owed are pushed before its socket closes. A
changed ``Register`` of a known session is a ``Deregister`` of the old one first.
A worker exception fails its room; the worker keeps running. An ``Abort`` from decode fails the
room with ``REASON_PEER_ABORTED``. A room refused on either side fails the other side's request
for it at once (:meth:`MooncakeKVManager.refuse`, :meth:`MooncakeKVManager.peer_refused`;
:mod:`kv.refusal`). Readiness goes to ``ready``. Every destination gets exactly one ``Status``
(:mod:`kv.mooncake_rooms`), and so does an ``Abort`` whose destination this rank does not hold;
an ``Abort`` that came after the room's ``Status`` was sent gets that ``Status`` again, marked
``again`` (the first may have been lost with its connection).

Rooms: ``clear()`` forgets a room; a destination that comes later is a new use's.
``quiescent()`` is False while a chunk of the room is queued or being written. ``close()`` fails
every live room, and a sender created or a chunk sent after it fails at once. Decode is told
nothing then; instead, once every transfer worker ended with no write in flight and the engines
are destroyed, the closed manager says so
(:attr:`MooncakeKVManager.writes_stopped`, with the decode sessions left holding pages for a
destination it never answered), for its server to tell decode peers at its bootstrap endpoint
(:meth:`kv.bootstrap.BootstrapServer.mark_unhealthy`); a worker that did not end leaves it None.

Hybrid state (``states=``, :mod:`kv.mooncake_state`): both sides register their state pools
too; a decode rank whose pools differ is refused at its ``Register`` (every room's destination
from it is answered FAILED, naming both sides' values); a sender takes the last chunk's
``state_indices`` (:meth:`MooncakeKVSender.send_state`), and the writes of every chunk carry the
draft pool's pages, those of the last chunk the state items, before the room can succeed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import zmq

from kv import wire
from kv.bootstrap import BootstrapClient
from kv.metadata import MetadataBuffers
from kv.model_id import describe_model
from kv.mooncake_engine import (
    ControlEndpoint,
    MooncakeConfig,
    MooncakeEngine,
    kv_dtype_name,
    push_socket,
    register_all,
)
from kv.mooncake_legs import Chunk, Owed, PrefillRoom
from kv.mooncake_rooms import MIN_SILENCE_S, AnsweredDrop, PrefillRooms, Repeated
from kv.mooncake_slices import Target, target_of
from kv.mooncake_state import pool_memory
from kv.mooncake_writes import WritePipeline
from kv.pool import KVPool
from kv.rank_table import RankInfo, RankPlace
from kv.routes import dp_rank_of
from kv.state_copy import check_state
from kv.state_pools import StateKind, StatePools
from kv.transfer import REASON_ABORTED, KVPoll, TransferError, TransferUsageError

logger = logging.getLogger(__name__)

#: How long a refusal to a decode rank that cannot pair (:class:`kv.wire.Refused`) may wait
#: for its connection before it is dropped.
_REFUSAL_LINGER_MS = 1000
#: How long the last statuses pushed to a decode session (forgotten, or registered anew) may take
#: to leave once its socket is closed.
_LAST_STATUS_LINGER_MS = 500
#: How long closing the manager waits for each transfer worker to end (its last write to
#: conclude).
WORKERS_STOP_S = 10.0
#: Why a room fails as the manager closes.
_CLOSED = "the prefill manager closed"
#: A listener tick this long (s) after the previous one ran late: the listener did not run
#: meanwhile, so keepalives may wait unread, and no session is judged silent on it.
_LATE_TICK_S = 3.0


@attrs.frozen
class WritesStopped:
    """A closed prefill rank's word that none of its KV writes is in flight or can start: its
    transfer workers ended, each having seen every write of its conclude (over TCP: its last
    bytes handed to the kernel, which delivers them a moment later), and its engines are
    destroyed."""

    rank: int
    #: The decode sessions left holding pages for a destination of this rank's that no
    #: ``Status`` answered (every registered one where control messages were left unread),
    #: each with how often it checks the prefill's health (seconds; 0: not known).
    unanswered: Mapping[str, float]


class MooncakeKVManager:
    """Prefill rank: engine, control listener, transfer workers; creates senders. With
    ``states`` (a hybrid model's pools beside ``pool``, :mod:`kv.mooncake_state`) its senders
    move them too."""

    def __init__(
        self,
        pool: KVPool,
        metadata: MetadataBuffers,
        *,
        place: RankPlace | None = None,
        config: MooncakeConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        states: StatePools | None = None,
    ) -> None:
        if states is not None and states.full is not pool:
            raise ValueError("the state pools' full pool must be the manager's KV pool")
        self.config = config = config or MooncakeConfig()
        self.pool = pool
        self.states = states
        self.carries_state = states is not None  # senders move state (``send_state``)
        self._state_memory = pool_memory(states)
        self.metadata = metadata
        self.place = place = place or RankPlace.single(num_layers=pool.num_layers,
                                                       kv_heads=pool.kv_heads)
        if (pool.kv_heads, pool.num_layers) != (place.heads_per_rank, len(place.layers)):
            raise ValueError(
                f"the pool holds {pool.kv_heads} heads of {pool.num_layers} layers, the rank's "
                f"place {place.heads_per_rank} heads of {len(place.layers)} layers")
        self.rank = place.rank
        self._meta_item_lens = tuple(i.item_len for i in metadata.buffer_infos())
        self._rooms = PrefillRooms(
            num_slots=metadata.num_slots,
            bootstrap_timeout_s=config.bootstrap_timeout_s,
            max_early_destinations=config.max_early_destinations,
            clock=clock,
        )
        self.ready = self._rooms.ready
        self._clock = clock
        self._last_tick = clock()
        self._push_lock = threading.Lock()
        self._push: dict[str, zmq.Socket[Any]] = {}
        self._submit_lock = threading.Lock()
        self._closing = False  # set by close(): no chunk is queued after
        self._close_lock = threading.Lock()  # one close; another caller waits for it
        self._closed = False
        #: Set by :meth:`close` once no write of this rank can land any more; None before,
        #: and after a close that could not make sure of it.
        self.writes_stopped: WritesStopped | None = None
        self._control = ControlEndpoint(
            config, pool, metadata, self._handle, name="mooncake-listen", log=logger,
            states=states, tick=self._tick,
        )
        self.endpoint = self._control.endpoint
        self.session = self._control.session  # its (first) engine's host:rpc_port
        self.dropped_messages = self._control.dropped_messages
        #: The engines the rank writes through (``config.engines``), each with the pool, the
        #: metadata and the state pools registered; the first is the control endpoint's. Tools
        #: that time raw writes beside pdlife's (``bench.transfer``) write through them.
        self.engines: tuple[MooncakeEngine, ...] = (self._control.engine,)
        writes: WritePipeline | None = None
        try:
            for _ in range(config.engines - 1):
                engine = MooncakeEngine(config)
                self.engines += (engine,)
                register_all(engine, pool, metadata, states)
            self._writes = writes = WritePipeline(
                self.engines, pool, metadata, self._rooms, config, self._tell_decode
            )
            # The listener's first tick measures from its start, not from the engines'
            # registration (a large pool's can take many seconds).
            self._last_tick = self._clock()
            self._control.start()
        except BaseException:
            self._abandon(writes)
            raise

    def _abandon(self, writes: WritePipeline | None) -> None:
        """Undo a construction that failed once the control endpoint existed, in reverse order
        (an open socket left in the context blocks the context's termination, which the
        garbage collector attempts, for ever): the listener stops if it started, the transfer
        workers (``writes``) if they did, then every socket of the context closes, then the
        context and the engines."""
        self._control.stop()
        if writes is not None:
            writes.close()
        self._control.ctx.destroy(linger=0)
        for engine in self.engines[1:]:
            engine.close()
        self._control.close()

    def rank_info(self) -> RankInfo:
        return RankInfo(
            rank=self.rank,
            endpoint=self.endpoint,
            session=self.session,
            page_size=self.pool.page_size,
            kv_dtype=kv_dtype_name(self.pool),
            model=self.pool.model,
            model_name=self.pool.model_name,
            kv_layout=self.pool.layout.value,
            head_dim=self.pool.head_dim,
            place=self.place,
        )

    def register_to_bootstrap(self, bootstrap_addr: str) -> None:
        BootstrapClient(bootstrap_addr, token=self.config.token).register(self.rank_info())

    def create_sender(self, bootstrap_addr: str, room: int) -> MooncakeKVSender:
        rec, owed = self._rooms.create(room)
        self._tell_decode(owed)
        return MooncakeKVSender(self._rooms, rec, self._submit, self._tell_decode, self.states)

    def live_rooms(self) -> int:
        return len(self._rooms)

    def watched_rooms(self) -> list[int]:
        """The rooms decode ranks watch before sending their destination (a leak check: none
        once every room ended on both sides; see :mod:`kv.mooncake_watch`)."""
        return self._rooms.watched()

    def decode_sessions(self) -> list[str]:
        """The decode sessions (engine ``host:rpc_port``) whose ``Register`` this rank took."""
        return self._rooms.sessions()

    def last_heard(self, session: str) -> float | None:
        """When (the manager's clock) ``session``'s ``Register`` last came, its keepalive
        included; None for a session not registered."""
        return self._rooms.heard(session)

    def refuse(self, room: int, reason: str) -> None:
        """This rank will not serve ``room``: decode's destination for it is answered with the
        refusal (see :mod:`kv.refusal`; any thread)."""
        self._tell_decode(self._rooms.refuse(room, reason))

    def peer_refused(self, room: int, reason: str) -> None:
        """The decode peer will never ask for ``room`` (a bootstrap refusal listener); a room
        another DP replica serves (:func:`kv.routes.dp_rank_of`) is not this rank's."""
        if dp_rank_of(room, self.place.dp_size) == self.place.dp_rank:
            self._tell_decode(self._rooms.peer_refused(room, reason))

    def close(self) -> None:
        """Stop serving: the chunks queued are written, then every live room fails, and a
        sender created or a chunk sent from now on fails at once, so every sender is
        quiescent; then the sockets and engines close. Decode is told nothing more (see
        :meth:`kv.mooncake_rooms.PrefillRooms.close`); :attr:`writes_stopped` says whether
        no write can land any more. Any thread; a second call waits for the first."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            listened = self._control.stop()
            # Destinations among control messages no one read: every session may hold one.
            unread = not listened or self._control.left_unread()
            with self._submit_lock:
                self._closing = True
            ended = self._writes.close(WORKERS_STOP_S)
            unanswered = self._rooms.close(_CLOSED, every_session=unread)
            with self._push_lock:
                for sock in self._push.values():
                    sock.close()
                self._push.clear()
            for engine in self.engines[1:]:
                engine.close()
            self._control.close()
            if ended:  # and every engine destroyed: none of their writes lands any more
                self.writes_stopped = WritesStopped(self.rank, unanswered)
            else:
                logger.warning("prefill rank %d closed with a transfer worker still running: "
                               "a write of it may still land, so decode peers are not told "
                               "its writes stopped", self.rank)

    def _submit(self, chunk: Chunk) -> None:
        """Queue ``chunk`` for the transfer workers; once the manager closes (they stop),
        conclude it failed instead, so its room is quiescent."""
        with self._submit_lock:
            if not self._closing:
                self._writes.submit(chunk)
                return
        self._rooms.conclude([chunk], chunk.session, _CLOSED, False)

    # -- control messages (listener thread) --------------------------------------------------

    def _handle(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.Register):
            self._on_register(msg)
        elif isinstance(msg, wire.Watch):
            self._tell_decode(self._rooms.watch(msg))
        elif isinstance(msg, wire.Destination):
            try:
                self._tell_decode(self._rooms.destination(msg))
            except AnsweredDrop as drop:  # answered, then counted and logged as a drop
                self._tell_decode(drop.owed)
                raise
        elif isinstance(msg, wire.Abort):
            self._tell_decode(self._rooms.peer_abort(msg))
        elif isinstance(msg, wire.Deregister):
            self._forget(msg.session, None)
            logger.info("decode session %s deregistered", msg.session)
        else:
            raise wire.WireError("unexpected_type", f"{type(msg).__name__} is not for prefill")

    def _on_register(self, reg: wire.Register) -> None:
        if self._rooms.touch(reg):  # the decode rank's keepalive
            return
        if self._rooms.known(reg.session):
            # Another registration of the session: another decode process on its engine port
            # (one restarted). Its rooms were the old process's memory.
            reason = (f"decode session {reg.session} registered anew (its decode process "
                      "restarted?): the rooms of its earlier registration failed")
            try:
                self._forget(reg.session, reason)
            except wire.WireError:  # forgotten meanwhile, by a caller on another thread
                pass
            else:
                logger.warning("%s", reason)
        try:
            target = self._target_of(reg)
        except wire.WireError as exc:
            self._refuse_session(reg, exc)
            raise
        if target.state.refused:
            logger.warning("decode session %s: its rooms are refused: %s", reg.session,
                           target.state.refused)
        self._rooms.register(target)
        with self._push_lock:
            old = self._push.pop(reg.session, None)
            if old is not None:
                old.close()
            self._push[reg.session] = push_socket(self._control.ctx, reg.status_endpoint)
        logger.info("decode session %s registered", reg.session)

    def _target_of(self, reg: wire.Register) -> Target:
        """What ``reg`` describes, for this rank; raises :class:`~kv.wire.WireError` when
        this rank cannot pair with it (another model, pool or metadata layout)."""
        if reg.model != self.pool.model:
            raise wire.WireError(
                "incompatible_model",
                f"session {reg.session}: its pool holds the KV of model "
                f"{describe_model(reg.model_name, reg.model)}, this rank's of "
                f"{describe_model(self.pool.model_name, self.pool.model)}",
            )
        mine = (self.pool.page_size, kv_dtype_name(self.pool), self.pool.layout.value,
                self._meta_item_lens)
        theirs = (reg.page_size, reg.kv_dtype, reg.kv_layout, reg.meta_item_lens)
        if mine != theirs:
            raise wire.WireError(
                "incompatible_layout",
                f"session {reg.session}: (page_size, kv_dtype, kv_layout, metadata item lens) "
                f"{theirs} differ from this rank's {mine}",
            )
        return target_of(self.pool, self.place, reg, self.states, self._state_memory)

    def _refuse_session(self, reg: wire.Register, err: wire.WireError) -> None:
        """Tell the decode rank of ``reg`` why it cannot pair with this rank (on a socket of
        its own: the session is not registered), so it fails its rooms for this prefill at
        once rather than at their timeouts."""
        sock = push_socket(self._control.ctx, reg.status_endpoint)
        try:
            sock.setsockopt(zmq.LINGER, _REFUSAL_LINGER_MS)  # sent once the connection is up
            # Without the session's name, which the decode rank knows: the reason is cut short
            # on the wire, and both sides' values are what it must keep.
            why = str(err).replace(f"session {reg.session}: ", "", 1)
            sock.send(wire.encode(wire.Refused(why, self.rank), self.config.token), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("refusal to decode session %s not sent: %s", reg.session, exc)
        finally:
            sock.close()

    def _forget(self, session: str, reason: str | None) -> None:
        """Forget ``session``: with ``reason`` (silent, registered anew) its rooms fail for it
        and the statuses it is owed leave on its socket before that closes; without (its
        ``Deregister``: it reads no more) only the other decode ranks of its rooms are told.
        Raises ``unknown_session`` for a session that is not registered."""
        owed = self._rooms.deregister(session, reason)
        if reason is not None:
            self._tell_decode(owed)
        with self._push_lock:
            sock = self._push.pop(session, None)
            if sock is not None:
                sock.close(linger=0 if reason is None else _LAST_STATUS_LINGER_MS)
        if reason is None:
            self._tell_decode(owed)  # its own stay owed (not sent): see _tell_decode

    def _tick(self) -> None:
        """The listener's periodic work (once a second): fail the rooms past their bootstrap
        timeout, so the scheduler sees them whether or not it polls them, and forget silent
        decode sessions, judged only when the listener has read every message that came
        before this tick and ran a moment ago (a tick that comes late follows a stall of the
        listener's own, during which keepalives may have queued unread)."""
        now = self._clock()
        since = now - self._last_tick
        if since < 1.0:
            return
        self._last_tick = now
        self._tell_decode(self._rooms.expire())
        if since >= MIN_SILENCE_S / 2:
            logger.warning("the control listener of prefill rank %d did not run for %.0f s; "
                           "decode sessions are judged silent only once it has read the "
                           "messages that came meanwhile", self.rank, since)
        if since < _LATE_TICK_S and self._control.caught_up():
            self.forget_silent(now)

    def forget_silent(self, now: float | None = None) -> list[str]:
        """Forget every decode session silent at ``now`` (the manager's clock; by default the
        present) for longer than its keepalive allows (:func:`kv.mooncake_rooms.silence_limit`:
        a decode rank killed, or its host gone, sends no ``Deregister``), as if it had
        deregistered: its live rooms fail, it is sent the statuses it is owed and its status
        socket closes. The sessions forgotten. The listener calls this once a second, when it
        has read every message waiting."""
        forgotten = []
        for session, quiet in self._rooms.silent(now):
            reason = f"decode session {session} went silent: no keepalive for {quiet:.0f} s"
            try:
                self._forget(session, reason)
            except wire.WireError:  # forgotten meanwhile, by a caller on another thread
                continue
            forgotten.append(session)
            logger.warning("%s; forgotten, with its rooms", reason)
        return forgotten

    def _tell_decode(self, owed: Sequence[Owed]) -> None:
        """Push the statuses owed to decode (any thread; never under the room table's lock).
        One that cannot be sent (its session is not registered, or its queue is full) is
        handed back to the room table, so the session's ``Abort`` of the room is answered."""
        lost: list[Owed] = []
        for o in owed:
            data = wire.encode(wire.Status(o.room, int(o.poll), o.reason, self.rank,
                                           again=isinstance(o, Repeated)), self.config.token)
            with self._push_lock:
                sock = self._push.get(o.session)
                if sock is None:  # it left (its rooms failed) or was forgotten
                    lost.append(o)
                    continue
                try:
                    sock.send(data, zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # a dead peer's queue is full
                    lost.append(o)
                    logger.warning("status for room %d to decode session %s not sent: %s",
                                   o.room, o.session, exc)
        if lost and not self._closing:  # see close()
            self._rooms.not_told(lost)
            logger.info("%d statuses to decode sessions %s not sent (gone, or not reading): "
                        "an Abort of one of those rooms is answered", len(lost),
                        ", ".join(sorted({o.session for o in lost})))


class MooncakeKVSender:
    """The prefill side of one room (see :mod:`kv.transfer` for the contract): a handle on the
    room's entry in the room table; chunks go to ``submit``, owed statuses to ``notify``."""

    def __init__(
        self,
        rooms: PrefillRooms,
        rec: PrefillRoom,
        submit: Callable[[Chunk], None],
        notify: Callable[[Sequence[Owed]], None],
        states: StatePools | None = None,
    ) -> None:
        self.room = rec.room
        self._states = states
        self._rooms = rooms
        self._rec = rec
        self._submit = submit
        self._notify = notify
        self._latched: KVPoll | None = None

    def init(self, num_pages: int, slot: int) -> None:
        self._notify(self._rooms.init(self._rec, num_pages, slot))

    def send_state(self, state: Mapping[StateKind, Sequence[int]]) -> None:
        """The last chunk's state_indices (``kv.state_sends.StateSender``): they are written
        with it, and the room succeeds only once they landed."""
        items = {StateKind(kind): [int(i) for i in values] for kind, values in state.items()}
        why = check_state(self._states, items, "prefill")
        if why:
            raise TransferUsageError(self.room, why)
        self._rooms.set_state(self._rec, items)

    def send(self, pages: Sequence[int], last: bool) -> None:
        chunks, owed = self._rooms.chunk(self._rec, pages, last)
        self._notify(owed)
        for chunk in chunks:
            self._submit(chunk)

    def poll(self) -> KVPoll:
        if self._latched is None:
            status, owed = self._rooms.poll(self._rec)
            self._notify(owed)
            if not status.terminal:
                return status
            self._latched = status
        return self._latched

    def failure_exception(self) -> TransferError:
        return self._rooms.failure(self._rec)

    def abort(self, why: str = "") -> None:
        self._notify(self._rooms.fail(self._rec, REASON_ABORTED, told=why))

    def clear(self) -> None:
        self._notify(self._rooms.clear(self._rec))

    def quiescent(self) -> bool:
        return self._rooms.quiescent(self._rec)
