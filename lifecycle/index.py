"""The state index of a lifecycle: how a checked batch moves between the per-state buckets.

Theory of operation
-------------------
A :class:`~lifecycle.machine.Lifecycle` files every live request in the bucket of its state: an
insertion-ordered dict, request id → request (the scheduler's queues *are* these buckets), and
keeps every live request by id. Invariant 4 (docs/architecture.md#invariants, checked by
``Lifecycle.check_index``): the buckets are exactly the live requests by state. So a batch is
legal for an edge out of ``src`` exactly when each of its requests is the one filed under its id
in ``src``'s bucket, and none appears twice; the index is the truth the checks read.

A common batch is a whole bucket in its own order: a forward batch whose requests all finish
their prompts leaves FORWARD together, a pass that schedules every waiting request empties WAITING.
:func:`whole_bucket` recognises it with one comparison of two lists (identity per element, in C),
and the move is then a bucket at once: ``dst.update(src)`` and ``src.clear()``, both in C, where a
batch of part of a bucket pays a delete and an insert per request. Either way each request's
state is set and the batch's one timeline entry (a tuple every request of it shares) appended.

Nothing here checks anything: callers move only batches they checked.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TypeVar

from lifecycle.record import Tracked

R = TypeVar("R", bound=Tracked)


def whole_bucket(bucket: Mapping[str, R], reqs: Sequence[R]) -> bool:
    """Whether ``reqs`` is ``bucket``, every request of it, in its order (so each is filed there,
    once). ``reqs`` that is not a list is never taken for a bucket (the caller checks it
    request by request instead)."""
    # list == list compares element by element, by identity first: records compare by
    # identity (eq=False), so this is one C loop with no __eq__ called.
    return len(reqs) == len(bucket) and reqs == [*bucket.values()]


def move_batch(
    reqs: Sequence[R],
    src: dict[str, R],
    dst: dict[str, R] | None,
    live: dict[str, R],
    state: enum.IntEnum,
    entry: tuple[float, str],
    whole: bool,
) -> None:
    """Move a checked batch out of bucket ``src`` into ``state``, appending ``entry`` to each
    timeline. ``dst`` is ``state``'s bucket (``src`` itself for a self-loop), where the batch
    lands at the end in batch order; None for a final state, where the batch leaves the index
    and ``live``, the live requests by id."""
    if whole:  # the bucket at once, in its order
        if dst is not src:  # (a self-loop of a whole bucket leaves it as it was)
            if dst is not None:
                dst.update(src)
            src.clear()
    elif len(src) == len(reqs):  # all of it in another order (or one request alone there)
        src.clear()
    else:
        for r in reqs:
            del src[r.rid]
    # One pass over the batch in each case: every loop costs an iterator.
    if dst is None:
        for r in reqs:
            del live[r.rid]
            r.state = state
            r.timeline.append(entry)
    elif whole:
        for r in reqs:
            r.state = state
            r.timeline.append(entry)
    else:
        for r in reqs:
            dst[r.rid] = r
            r.state = state
            r.timeline.append(entry)


def check_filing(
    index: Mapping[enum.IntEnum, Mapping[str, Tracked]], live: Mapping[str, Tracked]
) -> None:
    """Invariant 4: the per-state buckets are exactly the live requests by state."""
    total = 0
    for state, bucket in index.items():
        for rid, r in bucket.items():
            if r.state is not state or r.rid != rid or live.get(rid) is not r:
                raise AssertionError(f"index: {rid!r} filed under {state.name} but is {r.state!r}")
        total += len(bucket)
    if total != len(live):
        raise AssertionError(f"index: {total} requests filed, {len(live)} live")
