"""The bootstrap endpoint of a prefill server, and its client.

Theory of operation
-------------------
Each prefill rank registers itself with ``PUT /route`` (:class:`~kv.rank_table.RankInfo`: its
rank, the ZeroMQ endpoint where it takes decode control messages, its transfer-engine session,
page size, KV dtype, pool layout, head dim, the model whose KV its pool holds, and its place:
TP, PP and DP rank and size, the model's KV heads and layers and its stage's layers). A
registration that disagrees with the ranks already there is refused, naming both
(:func:`~kv.rank_table.registration_conflict`). A decode peer reads the table with
``GET /route``: 503 until every expected rank has registered, then the whole table, from which
it checks that its own pool matches and computes which ranks to contact (:mod:`kv.routes`)
before it sends anything.
``GET /health`` answers ``OK`` for liveness probes (with this endpoint's :attr:`~BootstrapServer.
instance` in an ``X-Pdlife-Instance`` header, as ``GET /route`` carries it: a decode peer tells a
prefill server restarted at the same address by it), or 503 with the reason once the server is
marked unhealthy (:meth:`BootstrapServer.mark_unhealthy`: its engine failed, or it shuts down).
Only a server that knows no rank of it writes any more adds ``"writes_stopped": true``, and a
decode peer's heartbeat then lets its rooms go at once. ``pdlife serve`` says so only once every
prefill rank behind its endpoint closed its KV manager with its transfer workers all ended and no
write in flight (:meth:`kv.mooncake.MooncakeKVManager.close`): on shutdown (rank processes and DP
replicas report it to rank 0 before its endpoint closes), and, for a server of one rank, once its
failed engine's manager closed; where a rank cannot confirm it (killed, failed, a worker that did
not end) it does not, and decode holds their pages until each room's ``Status`` or its release
bound. A decode rank's health check names its engine session (``X-Pdlife-Session``), so a prefill
shutting down knows which peers read that its writes stopped (:meth:`BootstrapServer.wait_read`)
and keeps its endpoint up only until those that hold its rooms were sent it. ``POST /refusal``
is how a decode peer says it will never ask for a room's KV (it refused the request, or gave up
before the handshake): the room and the reason go to every listener the prefill ranks in this
process added (:meth:`BootstrapServer.add_refusal_listener`; see :mod:`kv.refusal`).

The server is stdlib ``ThreadingHTTPServer`` in a daemon thread, bounded: at most
:data:`MAX_CONNECTIONS` connections are served at once (one beyond is closed as it is accepted,
not given a thread), and a connection silent for :data:`IDLE_TIMEOUT_S` (an unfinished request,
an idle keep-alive) is closed, so a flood of connections costs neither a thread each nor the
endpoint. It binds loopback unless told otherwise and port 0 picks a free port. Bodies are size-
limited JSON validated field by field: a bad request gets a 4xx with a reason and changes
nothing, and never ends the server. With a shared token, every route but ``/health`` requires
``Authorization: Bearer <token>`` (constant-time compare); a refused peer is logged with its
address (the first time, then every 100th) and counted (:attr:`BootstrapServer.unauthorized`).
``GET /route`` also says whether this endpoint requires a token (``token_required``), so a decode
peer whose token is useless here (prefill would never check it, and decode would drop prefill's
unauthenticated statuses) refuses to register instead of failing every room at its timeout.

The client (:class:`BootstrapClient`) trusts the server no more than the server trusts it: each
request has one deadline for all of it (connecting, sending, the status line, headers and body,
however slowly they come: a timeout per read would let a server that sends a byte now and then
hold the caller for ever), and an answer's body is read only up to :data:`MAX_ANSWER`.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import attrs

from kv.rank_table import PrefillInfo, RankInfo, registration_conflict

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

logger = logging.getLogger(__name__)

_MAX_BODY = 64 << 10
#: The largest answer body the client reads. A route table takes about 500 bytes a rank (1,024
#: ranks: 0.5 MB; 1.2 MB with 200-character model names and 191-character host names), so this
#: leaves room for any mesh while a server answering without end costs a decode little memory.
MAX_ANSWER = 4 << 20
#: Bytes of a body of unknown length read at a time.
_READ_CHUNK = 64 << 10
#: The header of every answer (``/health``'s included) that names the server instance.
INSTANCE_HEADER = "X-Pdlife-Instance"
#: The header of a decode rank's ``GET /health`` that names its engine session (the one its
#: ``Register`` names), so the server knows who read that its writes stopped.
SESSION_HEADER = "X-Pdlife-Session"
_MAX_SESSION = 256
#: The most sessions remembered as having read that the writes stopped.
_MAX_READERS = 4096
#: The field of ``/health``'s 503 answer that says the server's ranks write no KV any more
#: (:meth:`BootstrapServer.mark_unhealthy`); a 503 without it says nothing of the kind.
STOPPED_FIELD = "writes_stopped"
#: Connections served at once; the peers' requests are short (a look-up, a refusal, a health
#: check), so more than this is a flood.
MAX_CONNECTIONS = 64
#: Seconds a connection may send nothing before it is closed.
IDLE_TIMEOUT_S = 10.0
_MAX_ROOM = (1 << 64) - 1
_MAX_REASON = 512
#: What every prefill's route table (``GET /route``) holds.
_TABLE_FIELDS = ("ranks", "page_size", "kv_dtype")


class BootstrapError(Exception):
    """The bootstrap endpoint could not be reached or refused a request.

    ``status`` is the HTTP status (0 when no answer came); a 503 means the prefill ranks have not
    all registered yet, so retrying later can help.
    """

    def __init__(self, addr: str, status: int, detail: str) -> None:
        self.addr = addr
        self.status = status
        self.detail = detail
        super().__init__(f"bootstrap {addr}: {status or 'unreachable'}: {detail}")


class PrefillStopped(Exception):
    """The bootstrap endpoint answered that its server's ranks write no KV any more (its engine
    failed: :meth:`BootstrapServer.mark_unhealthy`), for ``reason``; ``instance`` is the server
    instance that said so. A decode peer lets go of the pages it holds for that server."""

    def __init__(self, addr: str, instance: str, reason: str) -> None:
        self.addr = addr
        self.instance = instance
        self.reason = reason
        super().__init__(f"bootstrap {addr}: the prefill server stopped writing KV: {reason}")


#: A refused peer is logged the first time and then every this many refusals (all are counted).
_LOG_EVERY = 100


class BootstrapServer:
    """``PUT /route``, ``GET /route``, ``GET /health`` for ``expected_ranks`` prefill ranks."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        expected_ranks: int = 1,
        token: str | None = None,
    ) -> None:
        if expected_ranks < 1:
            raise ValueError(f"expected_ranks must be >= 1, got {expected_ranks}")
        self.expected_ranks = expected_ranks
        self._token = token
        self._lock = threading.Lock()
        self._ranks: dict[int, RankInfo] = {}
        self._refusal_listeners: list[Callable[[int, str], None]] = []
        self._unauthorized = 0
        #: Why ``/health`` answers 503 (None: healthy).
        self.unhealthy: str | None = None
        self._writes_stopped = False
        # The decode sessions whose health check was answered that the writes stopped.
        self._read_stopped: set[str] = set()
        self._read = threading.Condition(self._lock)
        #: Drawn afresh by every server: another value at the same address is a restarted one.
        self.instance = secrets.token_hex(8)
        self._httpd = _BoundedServer((host, port), _make_handler(self))
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="pdlife-bootstrap",
            daemon=True,
        )
        self._thread.start()

    @property
    def registered(self) -> int:
        """How many of the :attr:`expected_ranks` have registered."""
        with self._lock:
            return len(self._ranks)

    def mark_unhealthy(self, reason: str, *, writes_stopped: bool = False) -> None:
        """From now on ``/health`` answers 503 with ``reason``. With ``writes_stopped`` (only
        once no rank behind this endpoint can write KV any more: none is left running, and no
        chunk is queued) the answer carries :data:`STOPPED_FIELD`, and decode peers let the
        pages they hold for this server go at their next health check; without it they hold
        them until each room's ``Status`` or their release bound. Once said, the writes stay
        stopped: a later call without ``writes_stopped`` changes only the reason."""
        with self._lock:
            self.unhealthy = reason
            self._writes_stopped = self._writes_stopped or writes_stopped

    @property
    def writes_stopped(self) -> bool:
        """Whether ``/health`` says that no rank behind this endpoint writes KV any more."""
        return self._writes_stopped

    def wait_read(self, sessions: Collection[str], timeout: float) -> set[str]:
        """Wait at most ``timeout`` seconds until every decode session of ``sessions`` has had
        a health check answered that the writes stopped (it names itself in
        :data:`SESSION_HEADER`; any thread); the sessions that had none by then."""
        with self._read:
            self._read.wait_for(lambda: self._read_stopped.issuperset(sessions), timeout)
            return set(sessions) - self._read_stopped

    def _health(self, session: str | None) -> tuple[int, Any]:
        """The answer to ``GET /health`` from a peer that named ``session``."""
        with self._lock:
            if self.unhealthy is None:
                return 200, "OK"
            if not self._writes_stopped:
                return 503, {"error": self.unhealthy}
            return 503, {"error": self.unhealthy, STOPPED_FIELD: True}

    def _note_read(self, session: str | None) -> None:
        """The peer that named ``session`` was sent the answer that writes stopped."""
        with self._lock:
            if session and len(session) <= _MAX_SESSION and (
                    len(self._read_stopped) < _MAX_READERS):
                self._read_stopped.add(session)
                self._read.notify_all()

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    def ranks(self) -> dict[int, RankInfo]:
        with self._lock:
            return dict(self._ranks)

    def add_refusal_listener(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(room, reason)`` (on an HTTP thread) for every refusal a decode peer
        posts."""
        with self._lock:
            self._refusal_listeners.append(listener)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    @property
    def unauthorized(self) -> int:
        """Requests refused for a missing or wrong token since the server started."""
        with self._lock:
            return self._unauthorized

    def _authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        want = f"Bearer {self._token}".encode()
        got = (header or "").encode("latin-1", "replace")
        return hmac.compare_digest(got, want)

    def _refused_peer(self, peer: str, method: str, path: str) -> None:
        with self._lock:
            self._unauthorized += 1
            n = self._unauthorized
        if n == 1 or n % _LOG_EVERY == 0:
            logger.warning(
                "refused %s %s from %s: missing or wrong peer token (refusal %d; both workers "
                "need the same --peer-token-file or PDLIFE_PEER_TOKEN, or MooncakeConfig.token)",
                method, path, peer, n)

    def _register(self, info: RankInfo) -> tuple[int, str]:
        with self._lock:
            problem = registration_conflict(info, self._ranks, self.expected_ranks)
            if problem is None:
                self._ranks[info.rank] = info
        if problem is not None:
            return 400, problem
        logger.info("prefill rank %d registered at %s", info.rank, info.endpoint)
        return 200, "OK"

    def _refused(self, body: Any) -> tuple[int, str]:
        if not isinstance(body, dict) or set(body) != {"room", "reason"}:
            return 400, "expected {\"room\": <uint64>, \"reason\": <string>}"
        room, reason = body["room"], body["reason"]
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= _MAX_ROOM:
            return 400, f"room must be a uint64, got {room!r}"
        if not isinstance(reason, str) or len(reason) > _MAX_REASON:
            return 400, f"reason must be a string of at most {_MAX_REASON} characters"
        with self._lock:
            listeners = list(self._refusal_listeners)
        logger.info("decode peer refused room %d: %r", room, reason)  # escaped: a peer wrote it
        for listener in listeners:
            try:
                listener(room, reason)
            except Exception:  # one rank's bug must not keep the refusal from the others
                logger.exception("a refusal listener failed for room %d", room)
        return 200, "OK"

    def _table(self) -> tuple[int, Any]:
        with self._lock:
            if len(self._ranks) < self.expected_ranks:
                return 503, {
                    "error": f"{len(self._ranks)} of {self.expected_ranks} prefill ranks registered"
                }
            ranks = [attrs.asdict(self._ranks[r]) for r in sorted(self._ranks)]
        return 200, {"page_size": ranks[0]["page_size"], "kv_dtype": ranks[0]["kv_dtype"],
                     "kv_layout": ranks[0]["kv_layout"], "model": ranks[0]["model"],
                     "model_name": ranks[0]["model_name"], "ranks": ranks,
                     "token_required": self._token is not None, "keepalive": True,
                     "watch": True, "instance": self.instance}


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection up to :data:`MAX_CONNECTIONS`; a connection beyond is closed."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._turned_away = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._turned_away += 1
            if self._turned_away % 1000 == 1:
                logger.warning("bootstrap endpoint: %d connections at once, the most it "
                               "serves: turning new ones away (%d so far; %s among them)",
                               MAX_CONNECTIONS, self._turned_away, client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that went away mid-request (a reset, a broken pipe) is not the server's error.
        logger.debug("bootstrap connection from %s failed", client_address, exc_info=True)


def _make_handler(server: BootstrapServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_TIMEOUT_S  # a read that waits longer closes the connection

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("bootstrap %s: " + format, self.client_address[0], *args)

        def _reply(self, status: int, body: Any) -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            ctype = "text/plain" if isinstance(body, str) else "application/json"
            self.send_header("Content-Type", ctype)
            self.send_header(INSTANCE_HEADER, server.instance)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _path(self) -> str:
            return self.path.split("?", 1)[0]

        def _authorized(self) -> bool:
            """True when the peer sent the token; otherwise answers 401 and counts it."""
            if server._authorized(self.headers.get("Authorization")):
                return True
            server._refused_peer(f"{self.client_address[0]}:{self.client_address[1]}",
                                 self.command, self._path())
            self._reply(401, {"error": "missing or wrong peer token"})
            return False

        def do_GET(self) -> None:
            path = self._path()
            if path == "/health":
                session = self.headers.get(SESSION_HEADER)
                status, body = server._health(session)
                self._reply(status, body)
                if isinstance(body, dict) and body.get(STOPPED_FIELD):
                    server._note_read(session)  # once its answer is written
            elif not self._authorized():
                pass
            elif path == "/route":
                self._reply(*server._table())
            else:
                self._reply(404, {"error": f"no route {path}"})

        def _body(self, route: str) -> bytes | None:
            """The request's body, once it is known to be for ``route`` and authorized;
            None after answering the error."""
            length_header = self.headers.get("Content-Length", "")
            if not length_header.isdigit() or int(length_header) > _MAX_BODY:
                self.close_connection = True
                self._reply(400, {"error": f"Content-Length must be 0..{_MAX_BODY}"})
                return None
            raw = self.rfile.read(int(length_header))
            if not self._authorized():
                return None
            if self._path() != route:
                self._reply(404, {"error": f"no route {self._path()}"})
                return None
            return raw

        def do_PUT(self) -> None:
            raw = self._body("/route")
            if raw is None:
                return
            try:
                info = RankInfo.from_json(json.loads(raw))
            except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
                self._reply(400, {"error": f"bad rank registration: {exc}"})
                return
            status, detail = server._register(info)
            self._reply(status, {"status": detail} if status == 200 else {"error": detail})

        def do_POST(self) -> None:
            raw = self._body("/refusal")
            if raw is None:
                return
            try:
                body = json.loads(raw)
            except ValueError as exc:
                self._reply(400, {"error": f"bad refusal: {exc}"})
                return
            status, detail = server._refused(body)
            self._reply(status, {"status": detail} if status == 200 else {"error": detail})

    return Handler


class BootstrapClient:
    """Talks to a bootstrap endpoint at ``addr`` ("host:port"); each request, all of it, takes
    at most ``timeout_s``."""

    def __init__(self, addr: str, *, timeout_s: float = 5.0, token: str | None = None,
                 session: str | None = None) -> None:
        """``session``: the decode rank's engine session, named in its health checks
        (:data:`SESSION_HEADER`)."""
        host, sep, port = addr.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"bootstrap address must be 'host:port', got {addr!r}")
        self.addr = addr
        self._host = host
        self._port = int(port)
        self._timeout_s = timeout_s
        self._token = token
        self._session = session

    def register(self, info: RankInfo) -> None:
        self._request("PUT", "/route", json.dumps(attrs.asdict(info)).encode())

    def lookup(self, deadline: float | None = None) -> PrefillInfo:
        """The prefill table; ``BootstrapError`` with status 503 while ranks are missing. With
        ``deadline`` (a ``time.monotonic()``), the request ends by then if not sooner."""
        body = self._exchange("GET", "/route", deadline=deadline)[0]
        try:
            table = json.loads(body)
            if not isinstance(table, dict):
                raise ValueError(f"a JSON {type(table).__name__}, not an object")
            missing = [k for k in _TABLE_FIELDS if k not in table]
            if missing:
                raise ValueError(f"missing fields {missing}")
            ranks = tuple(RankInfo.from_json(r) for r in table["ranks"])
            if not ranks:
                raise ValueError("no ranks")
            return PrefillInfo(
                page_size=int(table["page_size"]), kv_dtype=str(table["kv_dtype"]), ranks=ranks,
                token_required=table.get("token_required") is True,
                keepalive=table.get("keepalive") is True,
                watch=table.get("watch") is True,
                instance=str(table.get("instance", "")),
                model=ranks[0].model, model_name=ranks[0].model_name,
                kv_layout=ranks[0].kv_layout,
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise BootstrapError(self.addr, 200, f"unreadable route table (a prefill of another "
                                 f"pdlife version?): {exc}") from None

    def refuse(self, room: int, reason: str) -> None:
        """Tell the prefill server that this decode side will never ask for ``room``."""
        body = {"room": room, "reason": reason[:_MAX_REASON]}
        self._request("POST", "/refusal", json.dumps(body).encode())

    def health(self) -> bool:
        """Whether ``/health`` answers ``OK``."""
        try:
            return self.instance() is not None
        except PrefillStopped:
            return False

    def instance(self) -> str | None:
        """The server's instance when its ``/health`` answers ``OK`` ("" from a server that
        names none); None for no answer, or another one (a 503 that does not say the writes
        stopped: a server from before :data:`STOPPED_FIELD`, or not a bootstrap endpoint).
        :class:`PrefillStopped` when it answers that its ranks stopped writing KV."""
        try:
            status, body, instance = self._answer("GET", "/health")
        except BootstrapError:
            return None
        if status == 200:
            return instance if body == b"OK" else None
        if status == 503:
            try:
                answer = json.loads(body)
            except ValueError:
                return None
            if (isinstance(answer, dict) and answer.get(STOPPED_FIELD) is True
                    and isinstance(answer.get("error"), str)):
                raise PrefillStopped(self.addr, instance, answer["error"][:_MAX_REASON])
        return None

    def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        return self._exchange(method, path, body)[0]

    def _exchange(self, method: str, path: str, body: bytes | None = None,
                  deadline: float | None = None) -> tuple[bytes, str]:
        """The answer's body and the server's instance header ("" when it sends none), within
        ``timeout_s`` and by ``deadline`` (when given) in all; an answer other than 200 is a
        :class:`BootstrapError`."""
        status, data, instance = self._answer(method, path, body, deadline)
        if status != 200:
            raise BootstrapError(self.addr, status, data.decode(errors="replace")[:200])
        return data, instance

    def _answer(self, method: str, path: str, body: bytes | None = None,
                deadline: float | None = None) -> tuple[int, bytes, str]:
        """The answer's status, body and the server's instance header, whatever the status;
        a :class:`BootstrapError` when none came (see :meth:`_exchange`)."""
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        if self._session is not None and path == "/health":
            headers[SESSION_HEADER] = self._session
        end = time.monotonic() + self._timeout_s
        conn = _DeadlineConnection(self._host, self._port,
                                   end if deadline is None else min(end, deadline))
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = self._read(resp, f"{method} {path}")
        except (OSError, http.client.HTTPException) as exc:
            # Unreachable, too slow, or an answer cut short (a server shutting down mid-answer).
            raise BootstrapError(self.addr, 0, str(exc) or type(exc).__name__) from None
        finally:
            conn.close()
        return resp.status, data, resp.getheader(INSTANCE_HEADER, "")

    def _read(self, resp: http.client.HTTPResponse, what: str) -> bytes:
        """``resp``'s body; a :class:`BootstrapError` instead of one over :data:`MAX_ANSWER`
        (refused by its Content-Length before any of it is read, or once that much came)."""
        if resp.length is not None:  # a Content-Length
            if resp.length > MAX_ANSWER:
                raise self._too_large(resp, what, f"Content-Length {resp.length}")
            return resp.read()
        data = bytearray()  # chunked, or up to the end of the connection
        while chunk := resp.read(_READ_CHUNK):
            data += chunk
            if len(data) > MAX_ANSWER:
                raise self._too_large(resp, what, "no Content-Length")
        return bytes(data)

    def _too_large(self, resp: http.client.HTTPResponse, what: str,
                   size: str) -> BootstrapError:
        return BootstrapError(
            self.addr, resp.status,
            f"the answer to {what} is over {MAX_ANSWER >> 20} MiB ({size}), the most a peer "
            "reads (a route table of 1,024 ranks takes about 0.5 MB): is a pdlife bootstrap "
            "endpoint there?")


class _DeadlineConnection(http.client.HTTPConnection):
    """An HTTP connection that ends by ``deadline`` (a ``time.monotonic()``): connecting, and
    then every send and every read, waits at most until then, so a server that answers a
    byte at a time cannot stretch a request past it."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        super().__init__(host, port)
        self._deadline = deadline

    def connect(self) -> None:
        self.timeout = _left(self._deadline)
        super().connect()
        self.sock = _DeadlineSocket.adopt(self.sock, self._deadline)


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError when it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


class _DeadlineSocket(socket.socket):
    """A connected socket each of whose sends and receives waits at most until ``deadline``
    (the response reads through :meth:`recv_into`)."""

    deadline = 0.0

    @classmethod
    def adopt(cls, sock: socket.socket, deadline: float) -> _DeadlineSocket:
        """``sock``'s connection, now this class's (``sock`` is left detached)."""
        own = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        own.deadline = deadline
        return own

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0, /) -> None:
        self.settimeout(_left(self.deadline))
        super().sendall(data, flags)
