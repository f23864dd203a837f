"""The prefill ranks a Mooncake decode rank talks to: the bootstrap lookup and its checks, one
control socket per prefill rank, and each room's route (:mod:`kv.routes`).

Theory of operation
-------------------
The decode rank reads the prefill server's table at its bootstrap endpoint
(:func:`lookup_prefill`) and refuses a server it cannot pair with before it sends anything: a
peer token the server does not use, another model, page size, KV dtype or pool layout, and then
whatever :func:`kv.routes.check_pair` refuses for any rank (head dim, the model's layer and head
counts, MLA, TP sizes that do not divide one another), and one on another host where either
side's transfer engine and control sockets listen on loopback (:func:`check_reachable`: the
other side cannot reach them, and requests would wait out their timeouts).
:class:`PrefillPeers` opens a ZeroMQ PUSH socket to every rank of the table and sends each the
decode rank's ``Register``; a room's
``Destination`` and ``Abort`` go to the ranks its route names (the contacts of every stage of
the DP replica that serves the room), and a closing decode rank's ``Deregister`` to every rank.
Routes are cached by DP replica: they do not depend on the room otherwise.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from typing import Any

import zmq

from kv import wire
from kv.bootstrap import BootstrapClient, BootstrapError
from kv.model_id import describe_model
from kv.mooncake_engine import (
    IncompatiblePeerError,
    MooncakeConfig,
    MooncakeError,
    PeerAuthError,
    kv_dtype_name,
    push_socket,
)
from kv.pool import KVPool
from kv.rank_table import PrefillInfo, RankInfo, RankPlace
from kv.routes import DecodeRank, IncompatibleRanksError, PrefillRoute, check_pair, route

#: How long a closing decode rank's ``Deregister`` may wait to reach a prefill rank.
FAREWELL_LINGER_MS = 500


def decode_rank(pool: KVPool, place: RankPlace) -> DecodeRank:
    """The decode rank at ``place`` whose pool is ``pool``, as the pairing sees it."""
    if (pool.kv_heads, pool.num_layers) != (place.heads_per_rank, place.num_layers):
        raise ValueError(
            f"the pool holds {pool.kv_heads} heads of {pool.num_layers} layers, the decode "
            f"rank's place {place.heads_per_rank} heads of {place.num_layers} layers")
    return DecodeRank(page_size=pool.page_size, kv_dtype=kv_dtype_name(pool),
                      kv_layout=pool.layout.value, head_dim=pool.head_dim, model=pool.model,
                      place=place, model_name=pool.model_name)


def lookup_prefill(bootstrap_addr: str, config: MooncakeConfig, me: DecodeRank,
                   stop: threading.Event) -> PrefillInfo:
    """The prefill server's table, waiting up to ``connect_timeout_s`` for all its ranks;
    raises :class:`~kv.mooncake_engine.MooncakeError` (or a subclass naming the fix) when it
    cannot be reached or cannot serve ``me``. The timeout bounds the whole look-up, every
    try and all of each (a server that answers a byte at a time included)."""
    client = BootstrapClient(bootstrap_addr, token=config.token)
    deadline = time.monotonic() + config.connect_timeout_s
    while True:
        try:
            table = client.lookup(deadline)
            break
        except BootstrapError as exc:
            if exc.status == 401:
                raise PeerAuthError(
                    f"prefill bootstrap {bootstrap_addr} refused this decode's peer token "
                    f"({'none was sent' if config.token is None else 'a wrong one'}): "
                    "start both workers with the same --peer-token-file or "
                    "PDLIFE_PEER_TOKEN (MooncakeConfig.token in a library)") from exc
            if exc.status not in (0, 503):
                raise MooncakeError(f"prefill bootstrap lookup failed: {exc}") from exc
            # Tried again until the deadline, and only with time left: the error given up
            # with is the last try's own (a refused connection, a 503), not the "timed out"
            # of a try begun at the deadline.
            if stop.wait(max(0.0, min(0.05, deadline - time.monotonic()))):  # closing
                raise MooncakeError("prefill bootstrap lookup stopped: closing") from exc
            if time.monotonic() >= deadline:
                out = BootstrapError(exc.addr, exc.status, f"{exc.detail}; gave up after "
                                     f"--connect-timeout {config.connect_timeout_s:g} s")
                raise MooncakeError(f"prefill bootstrap lookup failed: {out}") from out
    if config.token is not None and not table.token_required:
        raise PeerAuthError(
            f"prefill at {bootstrap_addr} does not authenticate its peers but this decode "
            "has a peer token (it would drop prefill's unauthenticated statuses): start "
            "both workers with the same --peer-token-file or PDLIFE_PEER_TOKEN "
            "(MooncakeConfig.token in a library)")
    if table.model != me.model:
        raise IncompatiblePeerError(
            f"prefill at {bootstrap_addr} serves model {table.model_label}, this decode "
            f"serves {describe_model(me.model_name, me.model)}: one model's KV means nothing "
            "to another; start both with the same --model and --dtype (the reference model: "
            "the same --seed and shape flags too)")
    if (table.page_size, table.kv_dtype, table.kv_layout) != (
            me.page_size, me.kv_dtype, me.kv_layout):
        raise IncompatiblePeerError(
            f"prefill at {bootstrap_addr} has page_size={table.page_size} "
            f"kv_dtype={table.kv_dtype} kv_layout={table.kv_layout}, this decode pool has "
            f"page_size={me.page_size} kv_dtype={me.kv_dtype} kv_layout={me.kv_layout}; start "
            "both with the same --page-size, --dtype and --kv-layout")
    try:
        for rank in table.ranks:
            check_pair(rank, me)
    except IncompatibleRanksError as exc:
        raise IncompatiblePeerError(f"prefill at {bootstrap_addr}: {exc}") from None
    check_reachable(bootstrap_addr, table, config.hostname)
    return table


def check_reachable(bootstrap_addr: str, table: PrefillInfo, hostname: str) -> None:
    """:class:`~kv.mooncake_engine.IncompatiblePeerError` when the prefill server at
    ``bootstrap_addr`` is on another host (its address is not one of this host's) while its
    ranks' sockets, or this decode rank's (``hostname``), are on loopback, which the other host
    cannot reach: ``--host 0.0.0.0`` with the default ``--mooncake-host``."""
    host = bootstrap_addr.rpartition(":")[0]
    if _on_this_host(host):
        return
    fix = "to its address on the network (MooncakeConfig.hostname in a library)"
    for rank in table.ranks:
        where = rank.endpoint.removeprefix("tcp://").rpartition(":")[0]
        if _loopback(where):
            raise IncompatiblePeerError(
                f"prefill at {bootstrap_addr} is on another host, but its rank {rank.rank} "
                f"listens on {where} (loopback), which this host cannot reach: start the "
                f"prefill with --mooncake-host set {fix}")
    if _loopback(hostname):
        raise IncompatiblePeerError(
            f"prefill at {bootstrap_addr} is on another host, but this decode's transfer "
            f"engine and control sockets listen on {hostname} (loopback), which that host "
            f"cannot reach: start this decode with --mooncake-host set {fix}")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _on_this_host(host: str) -> bool:
    """Whether ``host`` names this machine (a loopback address, or one a socket can bind here);
    True when it does not resolve (the look-up itself then fails, saying so)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return True
    for family, kind, proto, _, addr in infos:
        if _loopback(str(addr[0])):
            return True
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((addr[0], 0))
            except OSError:
                continue
            return True
    return False


class PrefillPeers:
    """Control sockets to every rank of one prefill server, and the routes of its rooms."""

    def __init__(self, ctx: zmq.Context[Any], table: PrefillInfo, me: DecodeRank,
                 token: str | None) -> None:
        self.table = table
        self._me = me
        self._token = token
        self._lock = threading.Lock()
        self._sockets = {r.rank: push_socket(ctx, r.endpoint) for r in table.ranks}
        self._sessions = {r.rank: r.session for r in table.ranks}
        self._routes: dict[int, PrefillRoute[RankInfo]] = {}

    def route(self, room: int) -> PrefillRoute[RankInfo]:
        """Whom ``room``'s destination goes to and whose success completes it; raises
        :class:`~kv.routes.IncompatibleRanksError` when the table cannot serve it."""
        dp = room % self.table.ranks[0].place.dp_size
        with self._lock:
            found = self._routes.get(dp)
        if found is None:
            found = route(self.table.ranks, self._me, room)
            with self._lock:
                self._routes[dp] = found
        return found

    def session(self, rank: int) -> str:
        """The engine session of prefill rank ``rank`` (for messages)."""
        return self._sessions.get(rank, f"rank {rank}")

    def send(self, ranks: tuple[int, ...] | list[int], msg: wire.Message) -> None:
        """Send ``msg`` to each of ``ranks`` (any thread). A rank without a socket (these peers
        were closed: the prefill was lost and looked up again) is skipped: its rooms failed."""
        data = wire.encode(msg, self._token)
        with self._lock:
            for rank in ranks:
                sock = self._sockets.get(rank)
                if sock is not None:
                    sock.send(data)

    def send_all(self, msg: wire.Message) -> None:
        self.send(list(self._sockets), msg)

    def close(self, farewell: wire.Message | None = None) -> None:
        """Close the sockets; with ``farewell``, send it to every rank first, giving it up to
        :data:`FAREWELL_LINGER_MS` to leave (the context's termination waits at most that)."""
        data = None if farewell is None else wire.encode(farewell, self._token)
        with self._lock:
            for sock in self._sockets.values():
                if data is None:
                    sock.close()
                    continue
                with contextlib.suppress(zmq.ZMQError):  # a full queue: the rank reads nothing
                    sock.send(data, zmq.NOBLOCK)
                sock.close(linger=FAREWELL_LINGER_MS)
            self._sockets.clear()
