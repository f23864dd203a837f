"""The fake transfer backend: no data moves, the protocol is followed exactly.

Used for warm-up and health requests (bootstrap host ``2.2.2.2``), for driving a prefill
server with no decode peer, and for fuzzing the scheduler under injected faults.

Theory of operation
-------------------
A fake sender walks BOOTSTRAPPING → WAITING_FOR_INPUT → TRANSFERRING → SUCCESS. The handshake
completes when the sender is polled (after an optional delay counted in polls and/or seconds of
the injected clock); the transfer concludes on a poll after the last chunk was sent (again
after an optional delay), and never before every declared page was sent, so a chunked request
stays TRANSFERRING until its last chunk.

Faults are decided once per room, deterministically from ``(seed, room)``: a bootstrap failure
(the handshake fails), a bootstrap timeout (the handshake never completes; the scheduler's
deadline fails the request), or a transfer failure (the first ``send`` fails the room).

Readiness: the room is pushed onto ``manager.ready`` at creation, whenever a state changes, and
from every poll that is held back by a delay (the state will change on a later poll).

Parallel layouts are modelled by their counts (:mod:`kv.routes`). A prefill manager given its
rank's place and the decode layout waits for one destination per poll until it holds as many
as the rank owes decode ranks; a status-only rank concludes at its last ``send`` without a
transfer delay. A decode manager given the prefill layout and its own place completes a room
once as many source ranks reported as write into it, one at ``send_metadata()`` and one more
per poll.
"""

from __future__ import annotations

import logging
import queue
import random
import time
from collections.abc import Callable, Sequence

import attrs
from attrs.validators import ge, le

from kv.rank_table import RankPlace
from kv.routes import sender_duty, source_count
from kv.transfer import (
    REASON_ABORTED,
    KVPoll,
    SendCursor,
    TransferError,
    TransferUsageError,
    accepts_call,
)

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@attrs.frozen
class RoomFaults:
    """What goes wrong for one room."""

    bootstrap_failure: bool = False
    bootstrap_timeout: bool = False
    transfer_failure: bool = False


@attrs.frozen
class FaultPlan:
    """Seeded fault injection for the fake backend. Probabilities are per room; delays apply to
    every room (a phase ends once both its poll count and its seconds have passed)."""

    seed: int = attrs.field(default=0, validator=ge(0))
    bootstrap_failure: float = attrs.field(default=0.0, validator=[ge(0.0), le(1.0)])
    bootstrap_timeout: float = attrs.field(default=0.0, validator=[ge(0.0), le(1.0)])
    transfer_failure: float = attrs.field(default=0.0, validator=[ge(0.0), le(1.0)])
    handshake_delay_polls: int = attrs.field(default=0, validator=ge(0))
    handshake_delay_s: float = attrs.field(default=0.0, validator=ge(0))
    transfer_delay_polls: int = attrs.field(default=0, validator=ge(0))
    transfer_delay_s: float = attrs.field(default=0.0, validator=ge(0))

    def decide(self, room: int) -> RoomFaults:
        """The faults of ``room``: the same for the same ``(seed, room)`` in every run."""
        # An int seed is hashed deterministically (unlike str), so runs are reproducible.
        rng = random.Random((self.seed << 64) | room)
        bootstrap_failure = rng.random() < self.bootstrap_failure
        bootstrap_timeout = rng.random() < self.bootstrap_timeout
        transfer_failure = rng.random() < self.transfer_failure
        return RoomFaults(
            bootstrap_failure=bootstrap_failure,
            bootstrap_timeout=bootstrap_timeout and not bootstrap_failure,
            transfer_failure=transfer_failure,
        )


_NO_FAULTS = FaultPlan()


class _Delay:
    """A phase held back for a number of polls and seconds, counted from its start."""

    def __init__(self, polls: int, seconds: float, clock: Clock) -> None:
        self._polls_left = polls
        self._until = clock() + seconds
        self._clock = clock

    def poll_elapsed(self) -> bool:
        """Count one poll; True once the delay is over."""
        if self._polls_left > 0:
            self._polls_left -= 1
            return False
        return self._clock() >= self._until


class FakeKVManager:
    """Prefill side of the fake backend."""

    def __init__(self, faults: FaultPlan | None = None, clock: Clock = time.monotonic, *,
                 place: RankPlace | None = None, decode: RankPlace | None = None) -> None:
        self.faults = faults or _NO_FAULTS
        self.clock = clock
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        #: Destinations a sender waits for, and whether it only reports status (one, False
        #: without a layout).
        self.destinations, self.status_only = 1, False
        if place is not None and decode is not None:
            duty = sender_duty(place, decode)
            self.destinations, self.status_only = len(duty.destinations), duty.status_only

    def create_sender(self, bootstrap_addr: str, room: int) -> FakeKVSender:
        return FakeKVSender(self, bootstrap_addr, room, self.faults.decide(room))

    def refuse(self, room: int, reason: str) -> None:
        """No decode peer pairs with a fake room: nobody to tell."""

    def close(self) -> None:
        """Nothing to release: no threads, no buffers."""


class FakeKVSender:
    def __init__(
        self, manager: FakeKVManager, bootstrap_addr: str, room: int, faults: RoomFaults
    ) -> None:
        self.room = room
        self.bootstrap_addr = bootstrap_addr
        self.faults = faults
        self._manager = manager
        self._status = KVPoll.BOOTSTRAPPING
        self._reason = ""
        self._cursor = SendCursor(room)
        plan = manager.faults
        # One more poll per destination beyond the first: they arrive one at a time.
        self._delay = _Delay(plan.handshake_delay_polls + manager.destinations - 1,
                             plan.handshake_delay_s, manager.clock)
        if not faults.bootstrap_timeout:
            self._announce()

    @property
    def sent_pages(self) -> int:
        return self._cursor.sent

    def _announce(self) -> None:
        self._manager.ready.put(self.room)

    def _fail(self, reason: str) -> None:
        self._status = KVPoll.FAILED
        self._reason = reason
        logger.debug("fake sender room %d failed: %s", self.room, reason)
        self._announce()

    def poll(self) -> KVPoll:
        if self._status == KVPoll.BOOTSTRAPPING and not self.faults.bootstrap_timeout:
            if not self._delay.poll_elapsed():
                self._announce()
            elif self.faults.bootstrap_failure:
                self._fail("injected bootstrap failure")
            else:
                self._status = KVPoll.WAITING_FOR_INPUT
        elif self._status == KVPoll.TRANSFERRING and self._cursor.finished:
            if self._delay.poll_elapsed():
                self._status = KVPoll.SUCCESS
            else:
                self._announce()
        return self._status

    def init(self, num_pages: int, slot: int) -> None:
        if accepts_call(self.room, self._status, "init()"):
            self._cursor.init(num_pages, slot)

    def send(self, pages: Sequence[int], last: bool) -> None:
        if self._status == KVPoll.FAILED:
            return
        if self._cursor.num_pages is None:
            raise TransferUsageError(self.room, f"send() before init() while {self._status.name}")
        self._cursor.advance(len(pages), last)
        if self.faults.transfer_failure:
            self._fail("injected transfer failure")
            return
        self._status = KVPoll.TRANSFERRING
        if last:
            plan = self._manager.faults
            self._delay = _Delay(0, 0.0, self._manager.clock) if self._manager.status_only else (
                _Delay(plan.transfer_delay_polls, plan.transfer_delay_s, self._manager.clock))
            self._announce()

    def failure_exception(self) -> TransferError:
        return TransferError.reported(self.room, self._status, self._reason, self.bootstrap_addr)

    def abort(self, why: str = "") -> None:
        """``why`` has no one to go to: the fake has no peer."""
        if not self._status.terminal:
            self._fail(REASON_ABORTED)

    def clear(self) -> None:
        """Nothing is shared with other rooms, so there is nothing to forget."""

    def quiescent(self) -> bool:
        return True


class FakeDecodeManager:
    """Decode side of the fake backend."""

    def __init__(self, *, prefill: RankPlace | None = None,
                 place: RankPlace | None = None) -> None:
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        #: Source ranks a room waits for (one without a layout).
        self.sources = 1 if prefill is None or place is None else source_count(prefill, place)

    def create_receiver(self, bootstrap_addr: str, room: int) -> FakeKVReceiver:
        return FakeKVReceiver(self, bootstrap_addr, room)

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """No prefill server pairs with a fake room: nobody to tell."""

    def close(self) -> None:
        """Nothing to release."""


class FakeKVReceiver:
    """BOOTSTRAPPING until ``init()``, WAITING_FOR_INPUT until ``send_metadata()``, then
    TRANSFERRING until the manager's ``sources`` reported (the first at once, one more per
    poll) and SUCCESS; ``abort()`` → FAILED. Terminal states latch."""

    def __init__(self, manager: FakeDecodeManager, bootstrap_addr: str, room: int) -> None:
        self.room = room
        self.bootstrap_addr = bootstrap_addr
        self._manager = manager
        self._status = KVPoll.BOOTSTRAPPING
        self._reason = ""
        self.reported = 0  # source ranks that reported success

    def _set(self, status: KVPoll, reason: str = "") -> None:
        self._status = status
        self._reason = reason
        self._manager.ready.put(self.room)

    def init(self) -> None:
        if self._status == KVPoll.BOOTSTRAPPING:
            self._set(KVPoll.WAITING_FOR_INPUT)

    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        if accepts_call(self.room, self._status, "send_metadata()"):
            self._report()

    def _report(self) -> None:
        self.reported += 1
        done = self.reported >= self._manager.sources
        self._set(KVPoll.SUCCESS if done else KVPoll.TRANSFERRING)

    def poll(self) -> KVPoll:
        if self._status == KVPoll.TRANSFERRING:
            self._report()
        return self._status

    def failure_exception(self) -> TransferError:
        return TransferError.reported(self.room, self._status, self._reason, self.bootstrap_addr)

    def abort(self) -> None:
        if not self._status.terminal:
            self._set(KVPoll.FAILED, REASON_ABORTED)

    def clear(self) -> None:
        """Nothing is shared with other rooms, so there is nothing to forget."""

    def quiescent(self) -> bool:
        return True
