"""The transfer contract every backend (fake, local, mooncake) implements.

Theory of operation
-------------------
The prefill side has one :class:`KVManager` per rank and one :class:`KVSender` per request,
keyed by the request's bootstrap room. The decode side has one receiver per request. The
states a sender or receiver reports are :class:`KVPoll`, whose integer order is load-bearing:
ranks combine polls with MIN so that the most pessimistic state wins (any rank FAILED means
everyone sees FAILED; all must be SUCCESS).

Sender protocol (prefill):
1. ``manager.create_sender(addr, room)`` — the sender starts in BOOTSTRAPPING.
2. The decode peer's destination for the room arrives: ``poll()`` → WAITING_FOR_INPUT.
3. ``init(num_pages, slot)`` declares how many pages the request will send in total and which
   metadata-buffer row carries its first token.
4. ``send(pages, last)`` once per chunk; ``last=True`` on the final chunk, which also ships the
   metadata row. The backend concludes SUCCESS only after every declared page was written.
5. ``poll()`` → TRANSFERRING while work is outstanding, then SUCCESS or FAILED (latched).
6. ``clear()`` forgets the room; a late message for a cleared room is ignored, so a reused room
   is never poisoned.

Readiness is pushed: whenever a sender's state may have changed (handshake arrived, transfer
concluded, failure), the manager puts its room on :attr:`KVManager.ready`, a thread-safe queue
the scheduler drains, so a scheduler pass polls only the senders that changed.

Pages and concurrency: after ``abort()`` or a failure a worker thread may still be reading the
request's source pages. ``quiescent()`` tells whether any backend thread can still touch them;
the owner must not return the pages to the free list before it is True.
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Sequence
from typing import Protocol


class KVPoll(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class TransferError(Exception):
    """Why a room failed; ``peer`` names the decode (or prefill) endpoint when known."""

    def __init__(self, room: int, reason: str, peer: str = "", *, timeout: bool = False) -> None:
        self.room = room
        self.reason = reason
        self.peer = peer
        self.timeout = timeout
        where = f" (peer {peer})" if peer else ""
        super().__init__(f"room {room}: {reason}{where}")


class KVSender(Protocol):
    room: int

    def init(self, num_pages: int, slot: int) -> None: ...

    def send(self, pages: Sequence[int], last: bool) -> None: ...

    def poll(self) -> KVPoll: ...

    def failure_exception(self) -> TransferError: ...

    def abort(self) -> None: ...

    def clear(self) -> None: ...

    def quiescent(self) -> bool: ...


class KVManager(Protocol):
    """One per prefill rank: creates senders and pushes readiness."""

    ready: queue.SimpleQueue[int]

    def create_sender(self, bootstrap_addr: str, room: int) -> KVSender: ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """One per request on the decode side."""

    room: int

    def init(self) -> None: ...

    def send_metadata(self, pages: Sequence[int], slot: int) -> None: ...

    def poll(self) -> KVPoll: ...

    def failure_exception(self) -> TransferError: ...

    def abort(self) -> None: ...

    def clear(self) -> None: ...
