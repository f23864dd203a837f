"""Readiness and deadlines: which senders a pass polls, what their polls mean, and the slot
queue of requests whose handshake arrived.

A pass never polls every sender. The KV layer pushes the room of every sender whose state may
have changed onto its manager's ``ready`` queue; :class:`Deadlines` keeps a heap of the
bootstrap and transfer deadlines. :meth:`Readiness.poll` drains both, has the ranks agree on
the list (admission numbers) and MIN-combine the polls, and sorts the answers: handshakes,
transfers done, failures with their reasons. It fires nothing: the pass does.

:class:`SlotQueue` holds BOOTSTRAPPING·handshaken, the sub-state the table does not draw: the
decode peer's destination arrived but no metadata slot is free yet. Requests leave it in arrival
order as slots free up (``bootstrapped``), never failing for want of a slot; a request that
fails or ends while queued leaves it too. The queue is its one owner.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import attrs

from kv.metadata import SlotAllocator
from kv.pages import pages_needed
from kv.refusal import peer_aborted
from kv.transfer import REASON_OTHER_RANK, REASON_PEER_ABORTED, KVPoll, refusal
from lifecycle import FailureReason, PrefillRequest, PrefillState
from scheduler.dist.ranks import RankSync
from scheduler.messages import take_all
from scheduler.prefill.admission import Admission, sender_of
from scheduler.prefill.config import SchedulerConfig

S = PrefillState


class Deadlines:
    """The bootstrap and transfer deadlines, a heap of ``(deadline, number, state)``. An entry
    counts only while the request is still in that state with that deadline (re-arming or
    :meth:`disarm` leaves stale entries behind, which :meth:`expired` drops).

    Every request that passes through leaves stale entries that would otherwise stay until
    their deadlines pass: about two per request over a bootstrap timeout, whatever the number
    waiting. So when stale entries outnumber the live admissions (each holds at most one entry
    that counts) by :data:`STALE_SLACK`, :meth:`expired` rebuilds the heap from the entries
    that count; amortised over the pushes since the last rebuild, that is O(1) per entry."""

    #: How far the heap may outgrow twice the live admissions before it is rebuilt.
    STALE_SLACK = 1024

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._heap)

    def arm(self, req: PrefillRequest, seq: int, deadline: float) -> None:
        """``req`` (admission number ``seq``) must leave its current state by ``deadline``."""
        assert req.state is not None
        req.deadline = deadline
        heapq.heappush(self._heap, (deadline, seq, int(req.state)))

    @staticmethod
    def disarm(req: PrefillRequest) -> None:
        req.deadline = None

    def expired(self, now: float, admission: Admission) -> set[int]:
        """Pop the deadlines that passed by ``now``; the numbers of the requests they hold."""
        out: set[int] = set()
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, seq, state = heapq.heappop(heap)
            if _counts(admission, deadline, seq, state):
                out.add(seq)
        if len(heap) > 2 * len(admission) + self.STALE_SLACK:
            # A set: re-arming with the same deadline in the same state repeats an entry.
            self._heap = list({e for e in heap if _counts(admission, *e)})
            heapq.heapify(self._heap)
        return out


def _counts(admission: Admission, deadline: float, seq: int, state: int) -> bool:
    """Whether a deadline entry still holds: its request is live, in that state, with that
    deadline."""
    req = admission.by_seq(seq)
    return req is not None and req.state == state and req.deadline == deadline


class SlotQueue:
    """BOOTSTRAPPING·handshaken: requests whose destination arrived, waiting for a metadata
    slot in arrival order (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: dict[str, PrefillRequest] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, req: PrefillRequest) -> bool:
        """Queue a handshaken request; False if it was queued already."""
        if req.rid in self._queue:
            return False
        self._queue[req.rid] = req
        return True

    def discard(self, req: PrefillRequest) -> None:
        self._queue.pop(req.rid, None)

    def take(self, slots: SlotAllocator, page_size: int) -> list[PrefillRequest]:
        """Give queued requests a slot, in order, until none is free; each one's sender learns
        its page count and slot. The requests returned are ready for ``bootstrapped``."""
        ready: list[PrefillRequest] = []
        for rid in list(self._queue):
            req = self._queue[rid]
            if req.state is not S.BOOTSTRAPPING:
                del self._queue[rid]
                continue
            slot = slots.alloc()
            if slot is None:
                break  # no slot: wait, never fail
            del self._queue[rid]
            req.slot = slot
            sender = sender_of(req)
            assert sender is not None  # handshaken: its sender reported the destination
            sender.init(pages_needed(len(req.input_ids), page_size), slot)
            Deadlines.disarm(req)
            ready.append(req)
        return ready


@attrs.frozen
class Polled:
    """What one pass's polls found, for the pass to act on."""

    handshaken: list[PrefillRequest] = attrs.Factory(list)
    transferred: list[PrefillRequest] = attrs.Factory(list)
    failed: list[tuple[PrefillRequest, FailureReason, str]] = attrs.Factory(list)


class Readiness:
    """Polls what changed and what expired, agreed and MIN-combined across ranks."""

    def __init__(
        self, *, admission: Admission, deadlines: Deadlines, ranks: RankSync,
        config: SchedulerConfig,
    ) -> None:
        self._admission = admission
        self._deadlines = deadlines
        self._ranks = ranks
        self._config = config

    def poll(self, now: float) -> Polled:
        changed = set(self._pushed())
        expired = self._deadlines.expired(now, self._admission)
        keys = self._ranks.agree_keys(sorted(changed | expired))
        if not keys:
            return Polled()
        reqs = [self._admission.by_seq(k) for k in keys]
        local = [
            int(KVPoll.FAILED) if k in expired else _poll_one(r)
            for k, r in zip(keys, reqs, strict=True)
        ]
        out = Polled()
        for key, req, poll in zip(keys, reqs, self._ranks.min_reduce(local), strict=True):
            if req is None or req.state is None or req.is_final:
                continue
            if poll == KVPoll.FAILED:
                reason, detail = self._failure_of(req, key in expired)
                out.failed.append((req, reason, detail))
            elif req.state is S.BOOTSTRAPPING and poll >= KVPoll.WAITING_FOR_INPUT:
                out.handshaken.append(req)
            elif req.state is S.TRANSFERRING and poll == KVPoll.SUCCESS:
                out.transferred.append(req)
        return out

    def _pushed(self) -> Iterable[int]:
        """The admission numbers of the rooms the KV layer pushed since the last pass."""
        for manager in self._admission.managers:
            for room in take_all(manager.ready):
                seq = self._admission.seq_of_room(manager, room)
                if seq is not None:
                    yield seq

    def _failure_of(self, req: PrefillRequest, expired: bool) -> tuple[FailureReason, str]:
        bootstrapping = req.state is S.BOOTSTRAPPING
        if expired:
            if bootstrapping:
                return (
                    FailureReason.BOOTSTRAP_TIMEOUT,
                    f"no destination from the decode peer within "
                    f"{self._config.bootstrap_timeout:g} s",
                )
            return (
                FailureReason.TRANSFER_TIMEOUT,
                f"the transfer did not conclude within {self._config.transfer_timeout:g} s",
            )
        sender = sender_of(req)
        detail = REASON_OTHER_RANK
        timeout = False
        if sender is not None and int(sender.poll()) == KVPoll.FAILED:
            err = sender.failure_exception()
            if err.reason in _PEER_ABORTS or (err.refused and peer_aborted(err.reason)):
                # The decode side aborted the room (after the handshake, or before this half
                # came, withdrawing its destination) or its client aborted the request (before
                # its destination went out): the client went away, not a failure.
                return FailureReason.ABORTED, f"aborted by the decode peer ({err})"
            detail, timeout = str(err), bool(getattr(err, "timeout", False))
        if bootstrapping:
            reason = FailureReason.BOOTSTRAP_TIMEOUT if timeout else FailureReason.BOOTSTRAP_FAILED
        else:
            reason = FailureReason.TRANSFER_TIMEOUT if timeout else FailureReason.TRANSFER_FAILED
        return reason, detail


#: A room's reason when the decode side aborted it: with this half live, or before it came.
_PEER_ABORTS = (REASON_PEER_ABORTED, refusal(REASON_PEER_ABORTED))


def _poll_one(req: PrefillRequest | None) -> int:
    sender = None if req is None else sender_of(req)
    if req is None or sender is None or req.is_final:
        # Finished here (or unknown): nothing to add to the consensus.
        return int(KVPoll.SUCCESS)
    return int(sender.poll())
