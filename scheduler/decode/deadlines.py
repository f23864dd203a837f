"""The decode peer's waiting deadlines: how long an admitted request may wait for its KV.

A request gets one deadline when it is admitted; it fails if it is still waiting
(BOOTSTRAPPING, PREALLOC or RECEIVING) when the deadline passes: ``bootstrap_timeout`` in
PREALLOC (this side never had pages for it: prefill never got its destination),
``transfer_timeout`` otherwise (the peer chooses). The deadlines are a
heap of ``(deadline, rid)``; an entry counts only while its request is live with that deadline,
so a request that finished leaves a stale entry behind until its deadline passes.
"""

from __future__ import annotations

import heapq

from lifecycle import DecodeRequest, DecodeState, Lifecycle

S = DecodeState
#: The states in which a request still waits for its KV.
WAITING = frozenset((S.BOOTSTRAPPING, S.PREALLOC, S.RECEIVING))


class WaitingDeadlines:
    """The heap of waiting deadlines. Finished requests leave their entries until the deadline
    passes (rate x timeout of them), so when the heap outgrows twice the live requests by
    :attr:`stale_slack`, :meth:`expired` rebuilds it from the entries that count: amortised
    O(1) per entry."""

    #: How far the heap may outgrow twice the live requests before it is rebuilt.
    stale_slack = 1024

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._heap)

    def arm(self, req: DecodeRequest, deadline: float) -> None:
        """``req`` must have its KV by ``deadline``."""
        req.deadline = deadline
        heapq.heappush(self._heap, (deadline, req.rid))

    def expired(self, now: float, lifecycle: Lifecycle[DecodeRequest]) -> list[DecodeRequest]:
        """Pop the deadlines that passed by ``now``: the requests still waiting on them, in
        deadline order."""
        out: list[DecodeRequest] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            req = lifecycle.get(rid)
            if req is not None and req.deadline == deadline and req.state in WAITING:
                out.append(req)
        if len(heap) > 2 * len(lifecycle) + self.stale_slack:
            self._heap = [e for e in heap if _counts(lifecycle, *e)]
            heapq.heapify(self._heap)
        return out


def _counts(lifecycle: Lifecycle[DecodeRequest], deadline: float, rid: str) -> bool:
    req = lifecycle.get(rid)
    return req is not None and req.deadline == deadline
