"""Refused rooms: the short-lived record a side keeps of them, and the decode side's messenger
that tells a prefill server's bootstrap endpoint about them.

Theory of operation
-------------------
A PD router sends each request to a prefill and a decode server with the same bootstrap room.
When one of them refuses the request (draining, bad input, a room in use) or fails it before the
handshake, the other must not wait for a timeout (invariant 8). Both sides know the room and the
prefill server's bootstrap address from the request:

- prefill keeps a :class:`RefusedRooms` record of the rooms it will never serve, and answers a
  decode destination for one of them, now or later, with the refusal;
- decode tells the prefill server's bootstrap endpoint (``POST /refusal``, through a
  :class:`RefusalPoster`), which hands the room to the prefill ranks: a live request for it fails
  at once, and one that arrives later fails as soon as its sender is created (prefill keeps a
  second record for those).

Both records are bounded (the oldest entry goes first) and entries expire: a room number is the
router's random 64-bit choice, so a refusal is about one request, and a record that outlived it
must not refuse a later request that drew the same number. The default lifetime is as long as a
decode request may wait for its KV (``--waiting-timeout``, 300 s).

A refusal's reason is :func:`peer_refusal`'s text: the error type and HTTP status the refusing
side's client got, then why. Where that status is the client's to act on (:func:`for_the_client`),
the other half answers its client with the same type and status
(:func:`refused_for_the_client`), so a router passes on the same answer whichever worker it reads.
A prefill side that fails a request after the handshake for such a reason (a grammar the engine
cannot run, a shutdown) tells decode the same way, through its sender's ``abort(why)``.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kv.bootstrap import BootstrapClient, BootstrapError

logger = logging.getLogger(__name__)

#: How many refused rooms a record keeps, and for how many seconds.
CAPACITY = 4096
TTL_S = 300.0


def peer_refusal(kind: str, status: int, message: str) -> str:
    """What a side tells the other side of a request it refused or failed: the error type and
    HTTP status its client got, then why (the other half fails with ``peer refused: `` and
    this, :func:`kv.transfer.refusal`)."""
    return f"{kind} ({status}): {message}"


def for_the_client(status: int) -> bool:
    """Whether a failure answered with ``status`` is the client's to act on, so that the other
    half of the request answers it too: a 4xx (the request cannot be served as sent) or 503
    (the worker takes no requests now)."""
    return 400 <= status < 500 or status == 503


_PEER_REFUSED = re.compile(r"peer refused: ([a-z_]+) \((\d{3})\): ")


def refused_for_the_client(detail: str) -> tuple[str, int] | None:
    """The error type and status of a peer's refusal in ``detail`` that the client is to act
    on (:func:`for_the_client`), or None."""
    found = _PEER_REFUSED.search(detail)
    if found is None:
        return None
    kind, status = found.group(1), int(found.group(2))
    return (kind, status) if for_the_client(status) else None


def peer_aborted(detail: str) -> bool:
    """Whether ``detail`` carries the other half's word that its client aborted the request
    (``peer refused: aborted (200): ...``): this half ends as an abort too."""
    found = _PEER_REFUSED.search(detail)
    return found is not None and found.group(1) == "aborted"


class RefusedRooms:
    """Rooms refused recently, each with why. Not thread-safe: its owner's lock guards it."""

    def __init__(
        self, *, capacity: int = CAPACITY, ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or ttl_s <= 0:
            raise ValueError(f"capacity must be >= 1 and ttl_s > 0, got {capacity}, {ttl_s}")
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock
        self._rooms: OrderedDict[int, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._rooms)

    def add(self, room: int, reason: str) -> None:
        self._rooms.pop(room, None)
        self._rooms[room] = (self._clock() + self._ttl_s, reason)
        while len(self._rooms) > self._capacity:
            self._rooms.popitem(last=False)

    def get(self, room: int) -> str | None:
        """Why ``room`` was refused, unless it was not or the record expired."""
        self._expire()
        entry = self._rooms.get(room)
        return None if entry is None else entry[1]

    def pop(self, room: int) -> str | None:
        self._expire()
        entry = self._rooms.pop(room, None)
        return None if entry is None else entry[1]

    def _expire(self) -> None:
        now = self._clock()
        while self._rooms:
            room, (until, _) = next(iter(self._rooms.items()))
            if until > now:
                return
            del self._rooms[room]


class RefusalPoster:
    """Tells prefill bootstrap endpoints of rooms this decode side refused, on a thread of its
    own so the caller (the engine loop, an HTTP handler) never waits on the network. A post that
    gets no answer is tried ``attempts`` times; a refusal that cannot be delivered (the prefill
    is unreachable, the queue is full) is logged and dropped: the prefill's own timeout is then
    the fallback. Once :meth:`close` is called what is queued is posted once each, and not at
    all to a prefill that just did not answer: a worker shutting down does not wait out
    ``attempts`` timeouts per refusal for a prefill that hangs."""

    def __init__(self, *, token: str | None = None, timeout_s: float = 5.0, attempts: int = 3,
                 capacity: int = 10_000) -> None:
        self._token = token
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._queue: queue.Queue[tuple[str, int, str] | None] = queue.Queue(capacity)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.delivered = 0

    def tell(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Queue ``room``'s refusal for the prefill at ``bootstrap_addr`` (any thread)."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdlife-refusals",
                                                daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((bootstrap_addr, room, reason))
        except queue.Full:
            logger.warning("refusal of room %d for prefill %s dropped: %d refusals queued",
                           room, bootstrap_addr, self._queue.maxsize)

    def close(self) -> None:
        """Deliver what is queued (once each, see the class), then stop."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=30)

    def _run(self) -> None:
        silent: set[str] = set()  # the prefills that did not answer since closing began
        while (item := self._queue.get()) is not None:
            addr, room, reason = item
            if addr in silent:
                logger.warning("could not tell prefill %s that room %d was refused: it did "
                               "not answer the last refusal, and this side is closing",
                               addr, room)
                continue
            try:
                self._deliver(BootstrapClient(addr, timeout_s=self._timeout_s,
                                              token=self._token), room, reason)
                self.delivered += 1
            except (BootstrapError, ValueError) as exc:
                why = (f"{exc.status or 'unreachable'}: {exc.detail}"  # without the address
                       if isinstance(exc, BootstrapError) else str(exc))
                logger.warning("could not tell prefill %s that room %d was refused: %s",
                               addr, room, why)
                if self._closed and isinstance(exc, BootstrapError) and not exc.status:
                    silent.add(addr)

    def _deliver(self, client: BootstrapClient, room: int, reason: str) -> None:
        attempts = 1 if self._closed else self._attempts
        for attempt in range(1, attempts + 1):
            try:
                client.refuse(room, reason)
                return
            except BootstrapError as exc:
                if exc.status != 0 or attempt == attempts:  # refused, or out of tries
                    raise
