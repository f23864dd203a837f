"""What both sides of the Mooncake backend share: the engine, its config, errors, sockets.

One ``TransferEngine`` per side, initialised with the ``P2PHANDSHAKE`` metadata mode (no
metadata server: peers exchange segment descriptors directly), TCP here and RDMA where the
hardware has it; the KV pool tensor and the metadata buffers are registered whole. Control
messages (:mod:`kv.wire`) travel over ZeroMQ PUSH → PULL; :func:`serve_control` is the listener
loop of either side, and :class:`ControlEndpoint` holds what both sides run: the engine, the
control socket and its listener. The prefill side is :mod:`kv.mooncake`, the decode side
:mod:`kv.mooncake_decode`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from kv import wire
from kv.metadata import MetadataBuffers
from kv.native_log import HARMLESS, HARMLESS_ON_TCP, engine_log_captured
from kv.peer_token import peer_token_problem
from kv.pool import KVPool
from kv.state_pools import StatePools
from lifecycle.validators import one_of, typed_fields

logger = logging.getLogger(__name__)


class MooncakeError(Exception):
    """The transfer engine could not start, register memory, or reach its peer's setup."""


class IncompatiblePeerError(MooncakeError):
    """The prefill server's model, page size, KV dtype or pool layout differs from the decode
    pool's."""


class PeerAuthError(MooncakeError):
    """The prefill server refused this side's peer token, or the two sides disagree on whether
    peers authenticate; the fix is the same token on both workers."""


def _positive_or_none(_: object, attribute: attrs.Attribute[Any],
                      value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{attribute.name} must be > 0 or None, got {value!r}")


def _finite_seconds(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number of seconds > 0, got "
                         f"{value!r}")


#: How long (seconds) a decode room failed because its prefill counted as gone stays held, at
#: most, while a source sent no ``Status`` (``MooncakeConfig.lost_release_timeout_s``): SGLang
#: bounds a deferred decode KV release the same. A prefill that is cut off but still writes
#: past it writes into pages given back.
LOST_RELEASE_TIMEOUT_S = 30.0


#: How long (seconds) a prefill server shutting down keeps saying that its writes stopped, at
#: most, for the decode ranks holding its rooms to read it (``MooncakeConfig.
#: writes_stopped_wait_s``): twice the decode side's default heartbeat interval.
WRITES_STOPPED_WAIT_S = 10.0


def _seconds_or_zero(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number of seconds >= 0, got "
                         f"{value!r}")


@attrs.frozen(field_transformer=typed_fields)
class MooncakeConfig:
    """Engine and control-plane settings of one side."""

    hostname: str = "127.0.0.1"
    protocol: str = attrs.field(default="tcp", validator=one_of(("tcp", "rdma")))
    device: str = ""
    num_workers: int = attrs.field(
        default=2, validator=[attrs.validators.ge(1), attrs.validators.le(64)]
    )
    bootstrap_timeout_s: float = attrs.field(default=300.0, validator=attrs.validators.gt(0))
    connect_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    # Engine write blocks a transfer worker keeps submitted at once (the TCP transport queues
    # 1024 per peer by default: MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER).
    max_blocks_in_flight: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    # A run longer than this many bytes (in one region of the pool) is written as several
    # blocks: the TCP transport moves each block as one serial stream, so cutting the longest
    # runs keeps several streams busy, while each block costs a round trip (docs/backends.md:
    # 16 MiB moved churned pools 4-7% faster than 1 MiB over loopback TCP).
    max_block_bytes: int = attrs.field(default=16 << 20, validator=attrs.validators.ge(4096))
    max_early_destinations: int = attrs.field(default=4096, validator=attrs.validators.ge(1))
    # Prefill side: the transfer engines a rank writes through, each write's blocks dealt over
    # them in turn: over loopback TCP on two cores, two engines of one process wrote the same
    # bytes about 1.25 times as fast as one (docs/backends.md, Throughput); not measured on
    # RDMA. The decode side receives on one engine whatever this is.
    engines: int = attrs.field(default=1, validator=[attrs.validators.instance_of(int),
                                                     attrs.validators.ge(1),
                                                     attrs.validators.le(16)])
    # Prefill side, TCP: the connections ("lanes") an engine keeps to each decode peer, each
    # moving one block at a time, the next after the receiver acknowledged it (Mooncake's
    # MC_TCP_LANES_PER_PEER, 1-16, which this setting overrides; Mooncake's default, 4, is
    # pdlife's). Over loopback on two cores a sender with 16 lanes moved a churned round 1.05-1.30
    # times as fast as with 4, but as the default 16 made one Mooncake test time out in a
    # bootstrap once (docs/backends.md, Throughput). Applied while this side's engines start.
    tcp_lanes: int = attrs.field(default=4, validator=[attrs.validators.instance_of(int),
                                                        attrs.validators.ge(1),
                                                        attrs.validators.le(16)])
    # Decode side: the prefill bootstrap's /health is checked every heartbeat_interval_s; after
    # heartbeat_max_failures failures in a row the prefill counts as gone (SGLang: 5 s, 2).
    # While it answers, each prefill rank gets the Register again as often (the keepalive).
    heartbeat_interval_s: float = attrs.field(
        default=5.0, validator=[attrs.validators.gt(0), attrs.validators.le(3600)])
    heartbeat_max_failures: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    # Decode side, one manager per prefill server (scheduler.decode.router): a prefill that has
    # counted as gone this many seconds, with none of this side's rooms still open with it,
    # has its manager closed (engine, listeners, threads, heartbeat); a later request naming
    # that address connects anew. None keeps every manager until the decode server stops.
    retire_lost_after_s: float | None = attrs.field(default=60.0, validator=_positive_or_none)
    # Decode side: a room failed because its prefill counted as gone stays held (its pages
    # reserved) while a prefill rank may still write into it, for at most this many seconds
    # (kv.mooncake_decode).
    lost_release_timeout_s: float = attrs.field(default=LOST_RELEASE_TIMEOUT_S,
                                                validator=_finite_seconds)
    # Prefill side, at shutdown: once no rank of the server writes KV any more and its
    # bootstrap endpoint says so, it stays up for at most this many seconds while decode ranks
    # left holding pages for rooms it never answered have not read that at their next health
    # check (each within its own heartbeat_interval_s); none is waited for when no decode rank
    # holds such a room. 0 closes it at once (those decode ranks hold the pages until their
    # lost_release_timeout_s).
    writes_stopped_wait_s: float = attrs.field(default=WRITES_STOPPED_WAIT_S,
                                               validator=_seconds_or_zero)
    # The shared peer token: the bootstrap endpoint and every control message require it. Never
    # in a repr (configs get logged). At least MIN_PEER_TOKEN_CHARS visible ASCII characters.
    token: str | None = attrs.field(default=None, repr=False)

    @token.validator
    def _check_token(self, _attr: object, value: str | None) -> None:
        problem = peer_token_problem(value)
        if problem:
            raise ValueError(f"MooncakeConfig.token {problem}")
    # The engine's log level (Mooncake reads MC_LOG_LEVEL: INFO, WARNING or ERROR), applied when
    # the process environment does not set MC_LOG_LEVEL itself; the engine library reads it once,
    # so the first engine of a process decides. At INFO it logs every connection and segment.
    log_level: str = attrs.field(
        default="WARNING", validator=one_of(("INFO", "WARNING", "ERROR"))
    )


_LANES_ENV = "MC_TCP_LANES_PER_PEER"
_engine_start = threading.Lock()  # one engine reads the environment at a time


def _apply_lanes(lanes: int) -> None:
    """The TCP transport reads its lanes per peer from the process environment as an engine
    initialises, so pdlife sets ``MC_TCP_LANES_PER_PEER`` there (overriding a value found) and
    leaves it: a process whose engines share one setting changes its environment once, before
    its first engine's threads exist (setenv racing a native thread's getenv is unsafe)."""
    if os.environ.get(_LANES_ENV) != str(lanes):
        os.environ[_LANES_ENV] = str(lanes)


def kv_dtype_name(pool: KVPool) -> str:
    return str(pool.dtype).removeprefix("torch.")


#: The port range the transfer engine takes its listeners from unless told otherwise.
DEFAULT_RPC_PORTS = (15000, 17000)


@functools.cache
def _port_range_env() -> tuple[str | None, str | None]:
    """``MC_MIN_RPC_PORT`` and ``MC_MAX_RPC_PORT`` as the process's first engine read them:
    Mooncake reads its configuration once per process."""
    return os.environ.get("MC_MIN_RPC_PORT"), os.environ.get("MC_MAX_RPC_PORT")


def _port_range() -> tuple[str, str] | None:
    """The range the environment gives, a bound it leaves out at its default; None when it
    gives none."""
    given = _port_range_env()
    if given == (None, None):
        return None
    low, high = (value or str(default) for value, default in zip(given, DEFAULT_RPC_PORTS,
                                                                 strict=True))
    return low, high


def port_range_problem() -> str:
    """Why Mooncake would not take the ``MC_MIN_RPC_PORT`` .. ``MC_MAX_RPC_PORT`` range in the
    environment, or "": what a server checks before it starts any engine (a decode server's
    starts with its first request). Mooncake (0.3.13) takes a range of port numbers that ends
    below 32768, and falls back to 15000-17000 for any other."""
    given = _port_range()
    if given is None:
        return ""
    low, high = given
    where = f"MC_MIN_RPC_PORT..MC_MAX_RPC_PORT is {low}-{high}"
    if low.isdigit() and high.isdigit() and 0 < int(low) < int(high) < 32768:
        return ""
    if low.isdigit() and high.isdigit() and 0 < int(low) == int(high) < 32768:
        # Measured: an engine did not start on a range of one port (it takes two or more).
        return (f"{where}: one port, and a transfer engine listens on more than one; give a "
                f"range of a few ports per engine (docs/security.md)")
    if low.isdigit() and high.isdigit() and int(low) > int(high):
        why = "the range is reversed"
    elif not (low.isdigit() and high.isdigit()):
        why = "not port numbers"
    else:
        why = "the Mooncake transfer engine takes only a range that ends below 32768"
    return (f"{where}: {why}; the engine would listen on {DEFAULT_RPC_PORTS[0]}-"
            f"{DEFAULT_RPC_PORTS[1]} instead (docs/security.md)")


def ignored_port_range(port: int) -> str:
    """Why the engine listening on ``port`` did not take ``MC_MIN_RPC_PORT`` ..
    ``MC_MAX_RPC_PORT`` from the environment, or "" when it did (or neither is set). Mooncake
    (0.3.13) falls back to 15000-17000 for a range it does not take (one that reaches 32768 or
    above, or is not a range), saying so only in its own log: a firewall written for the range
    given would miss the ports the engine listens on."""
    given = _port_range()
    if given is None:
        return ""
    low, high = given
    if low.isdigit() and high.isdigit() and int(low) <= port <= int(high):
        return ""
    return (f"MC_MIN_RPC_PORT..MC_MAX_RPC_PORT asks for ports {low}-{high}, but the Mooncake "
            f"transfer engine took {port}: it ignores a range that reaches 32768 or above (or "
            f"is not a range of port numbers) and uses {DEFAULT_RPC_PORTS[0]}-"
            f"{DEFAULT_RPC_PORTS[1]}; give a range that ends below 32768 (docs/security.md)")


class MooncakeEngine:
    """One TransferEngine with its registered regions; ``session`` is ``host:rpc_port``."""

    def __init__(self, config: MooncakeConfig) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", config.log_level)  # read when the engine loads
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise MooncakeError(
                "the Mooncake backend needs `pip install mooncake-transfer-engine-non-cuda` and "
                f"Debian's libibverbs1: {exc}"
            ) from exc
        # The engine prints a few harmless ERROR/WARNING lines as it starts (kv.native_log).
        harmless = HARMLESS_ON_TCP if config.protocol == "tcp" else HARMLESS
        with engine_log_captured(logger, harmless), _engine_start:
            _apply_lanes(config.tcp_lanes)
            _port_range_env()  # what the engine reads now, once per process
            self._engine: Any = TransferEngine()
            rc = self._engine.initialize(
                config.hostname, "P2PHANDSHAKE", config.protocol, config.device
            )
        if rc != 0:
            raise MooncakeError(
                f"TransferEngine.initialize({config.hostname!r}, P2PHANDSHAKE, "
                f"{config.protocol!r}, {config.device!r}) returned {rc}"
            )
        port = self._engine.get_rpc_port()
        self.session = f"{config.hostname}:{port}"
        self._regions: list[int] = []
        ignored = ignored_port_range(port)
        if ignored:
            self.close()
            raise MooncakeError(ignored)

    def register(self, ptr: int, length: int) -> None:
        rc = self._engine.register_memory(ptr, length)
        if rc != 0:
            raise MooncakeError(f"register_memory({ptr:#x}, {length}) returned {rc}")
        self._regions.append(ptr)

    def submit_write(self, session: str, src: list[int], dst: list[int], lens: list[int]) -> int:
        """Start one batch write; its batch id, or 0 when the engine refused it."""
        batch: int = self._open().batch_transfer_async_write(session, src, dst, lens)
        return batch

    def wait(self, batch: int) -> int:
        """Block until the batch ``submit_write`` returned concludes: 0 on success."""
        rc: int = self._open().get_batch_transfer_status([batch])
        return rc

    def _open(self) -> Any:
        engine = self._engine
        if engine is None:
            raise MooncakeError(f"the transfer engine of {self.session} is closed")
        return engine

    def close(self) -> None:
        """Unregister the regions and destroy the engine: its listeners, lane sockets and
        threads end here. The binding has no close; the engine goes when its last reference
        drops, which is this object's (a call in progress on another thread holds its own until
        it returns). Destroying an engine takes about a second, holding Python's interpreter
        lock throughout (Mooncake 0.3.13), so every thread of the process stalls that long: at
        a close the caller chose, rather than whenever the garbage collector frees a closed
        manager (a collection freeing many froze a process for as many seconds)."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        for ptr in self._regions:
            engine.unregister_memory(ptr)
        self._regions.clear()
        del engine


def register_all(engine: MooncakeEngine, pool: KVPool, metadata: MetadataBuffers,
                 states: StatePools | None = None) -> None:
    """Register the KV pool, the metadata buffers and every pool of ``states`` beside the KV
    pool (the draft's, the state pools) whole."""
    pools = [("the KV pool", pool.buffer)]
    if states is not None:
        pools += [(f"the {name} pool", p.buffer) for name, p in states.named_pools().items()]
    for name, buffer in pools:
        if not buffer.is_contiguous():
            raise MooncakeError(f"{name}'s buffer must be contiguous to be registered")
        engine.register(buffer.data_ptr(), buffer.numel() * buffer.element_size())
    for info in metadata.buffer_infos():
        engine.register(info.ptr, info.length)


#: The longest wait between a push socket's attempts to reach a peer that does not answer.
#: ZeroMQ retries every 100 ms by default, for ever: a prefill rank keeps the status socket of
#: every decode rank that registered, also of one gone, and 200 such sockets cost it 6.6% of a
#: core in connection attempts; doubling the wait up to a second cost 0.5% (measured over
#: loopback). A peer back after a network blip hears from this side at most a second later.
RECONNECT_MAX_MS = 1000


def push_socket(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    return sock


#: Dropped-message reasons logged every time: a peer configured unlike this side (a decode
#: sends each once per connection).
_ALWAYS_LOGGED = frozenset({"incompatible_layout", "incompatible_model"})
#: The most messages the listener handles in a row before its periodic work.
_MAX_IN_A_ROW = 1000


def serve_control(
    pull: zmq.Socket[Any],
    stop: threading.Event,
    token: str | None,
    handle: Callable[[wire.Message], None],
    dropped: wire.DroppedMessages,
    log: logging.Logger,
    tick: Callable[[], None] | None = None,
) -> None:
    """Hand each control message arriving on ``pull`` to ``handle`` until ``stop`` is set, and
    call ``tick`` once the messages waiting were handled (at most :data:`_MAX_IN_A_ROW` in a
    row) and after each 100 ms without one, so that what it judges from the messages (a
    keepalive that did not come) is judged after those that were waiting.

    A bad message (:class:`~kv.wire.WireError`, from decoding or from ``handle``) is logged on
    ``log``, counted in ``dropped`` and dropped; so is a message whose handler raised anything
    else. Neither ends the loop. A late message for a room this side already forgot
    (``stale_room``: an abort racing the room's end) is routine and logged at DEBUG; a peer's
    misconfiguration (another model or pool layout) at WARNING; of the others, the first of each
    reason and every 1000th at WARNING, the rest at DEBUG.
    """
    while not stop.is_set():
        waiting = bool(pull.poll(100))
        for _ in range(_MAX_IN_A_ROW):
            if not waiting:
                break
            _serve_one(pull.recv(), token, handle, dropped, log)
            waiting = bool(pull.poll(0))
        if tick is not None:
            try:
                tick()
            except Exception:  # nor a bug of the periodic work
                log.exception("control listener tick failed")


def _serve_one(data: bytes, token: str | None, handle: Callable[[wire.Message], None],
               dropped: wire.DroppedMessages, log: logging.Logger) -> None:
    """Decode and handle one control message; a bad one is counted, logged and dropped."""
    try:
        handle(wire.decode(data, token))
    except wire.WireError as err:
        n = dropped.record(err)
        # A peer's misconfiguration every time; other reasons the first time, then every
        # 1000th: a flood of bad messages must not flood the log (the counter has all).
        loud = err.reason in _ALWAYS_LOGGED or (
            err.reason != "stale_room" and (n == 1 or n % 1000 == 0))
        log.log(logging.WARNING if loud else logging.DEBUG,
                "dropped control message: %s%s", err,
                f" ({n} dropped for {err.reason} so far)" if n > 1 else "")
    except Exception:  # a handler bug must not end the listener
        log.exception("control message handler failed")
        dropped.record(wire.WireError("internal", "handler raised"))


class ControlEndpoint:
    """One side's engine, with the KV pool, metadata buffers and state pools registered, and
    its control plane: a ZeroMQ PULL socket bound to a free port of ``config.hostname``
    (:attr:`endpoint`) and the listener thread that hands each message to ``handle`` once
    :meth:`start` ran. A construction that fails closes what it opened before the error goes
    on: a socket left open in its context would block the context's termination, which the
    garbage collector attempts, for ever."""

    def __init__(
        self,
        config: MooncakeConfig,
        pool: KVPool,
        metadata: MetadataBuffers,
        handle: Callable[[wire.Message], None],
        *,
        name: str,
        log: logging.Logger,
        states: StatePools | None = None,
        tick: Callable[[], None] | None = None,
    ) -> None:
        self.engine = MooncakeEngine(config)
        self.dropped_messages = wire.DroppedMessages()
        ctx: zmq.Context[Any] | None = None
        try:
            register_all(self.engine, pool, metadata, states)
            ctx = zmq.Context()
            self._pull = ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.LINGER, 0)
            # A bigger message is refused by ZeroMQ as it arrives (the peer is disconnected),
            # before any of it is buffered: the wire check of the size comes after the whole
            # message.
            self._pull.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
            port = self._pull.bind_to_random_port(f"tcp://{config.hostname}")
        except BaseException:
            if ctx is not None:
                ctx.destroy(linger=0)  # its sockets close first, at linger 0
            self.engine.close()
            raise
        self.ctx: zmq.Context[Any] = ctx
        self.endpoint = f"tcp://{config.hostname}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=serve_control,
            args=(self._pull, self._stop, config.token, handle, self.dropped_messages, log,
                  tick),
            name=name,
            daemon=True,
        )

    @property
    def session(self) -> str:
        return self.engine.session

    def start(self) -> None:
        self._thread.start()

    def caught_up(self) -> bool:
        """Whether no control message waits to be handled: every message that came before the
        call was. Only on the listener thread (from its ``tick``): the socket is its own."""
        return not self._pull.poll(0)

    def stop(self) -> bool:
        """Stop the listener (the engine and the context stay open); whether it ended."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return not self._thread.is_alive()

    def left_unread(self) -> bool:
        """Whether control messages came that the listener never handled; only once
        :meth:`stop` said it ended (the socket is no thread's then)."""
        return bool(self._pull.poll(0))

    def close(self) -> None:
        """Stop the listener, then close the socket, the context and the engine; every push
        socket of :attr:`ctx` must be closed first."""
        self.stop()
        self._pull.close()
        self.ctx.term()
        self.engine.close()
