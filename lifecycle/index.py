"""The state index of a lifecycle: how a batch moves between the per-state buckets.

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
:func:`whole_bucket` recognises it with one pass over the two (identity per element, in C: records
are matched by identity everywhere, never by ``==``, which a record class may define field-wise),
and the move is then a bucket at once: ``dst.update(src)`` and ``src.clear()``, both in C, where a
batch of part of a bucket pays a delete and an insert per request. Either way each request's
state is set and the batch's one timeline entry (a tuple every request of it shares) appended.
:func:`move_batch` moves a batch its caller checked.

A batch that is part of its bucket, on an edge to another state, is checked and moved in one pass
instead (:func:`claim`): each request is checked (in ``src``, the very record ``src``'s bucket
files under its id, so of this lifecycle and not a copy, its guard if the edge has one) and at
once *claimed*: its state set to the destination, the batch's timeline entry
appended, and it is filed in the destination's bucket. The claim is the check that the batch
holds no request twice: a request met again is no longer in ``src``. A refusal undoes the claims
made before it (:func:`unclaim`: the claimed requests are those whose last timeline entry is the
batch's, a tuple made for this batch alone), so that nothing has changed when the caller raises;
the destination bucket gets back what it held, in its order, because the claimed requests were
appended after it. Only then does the batch leave its source bucket (:func:`leave`): that bucket
is untouched until nothing can be refused, because a delete could not be undone in place.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from operator import is_
from typing import TypeVar

from lifecycle.record import Tracked

R = TypeVar("R", bound=Tracked)


def whole_bucket(bucket: Mapping[str, R], reqs: Sequence[R]) -> bool:
    """Whether ``reqs`` is ``bucket``, every request of it, in its order (so each is filed there,
    once), comparing records by identity."""
    # Not list == list: that calls __eq__ on records that are not the same object, and a
    # record class with attrs' default eq=True says a copy equals the record it was copied
    # from. map(is_) is the same C loop, by identity only.
    return len(reqs) == len(bucket) and all(map(is_, reqs, bucket.values()))


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


def claim(
    reqs: Sequence[R],
    filed: Mapping[str, R],
    src: enum.IntEnum,
    dst: enum.IntEnum,
    bucket: dict[str, R] | None,
    entry: tuple[float, str],
    guard: Callable[[R], object] | None = None,
    wanted: bool = True,
) -> R | None:
    """Claim each request of ``reqs`` for the edge ``src`` → ``dst`` (not a self-loop) in batch
    order: it must be in ``src`` and be the request ``filed``, the source bucket, holds under its
    id (so it is the owner's, not a copy), and ``guard(r)``, when given, must answer
    ``wanted``; then its state becomes ``dst``, ``entry`` is appended to its timeline and it is
    filed in ``bucket``, the destination's (None for a final state). Return the first request
    that could not be claimed, with the claims before it still made (:func:`unclaim` undoes
    them), or None. The source bucket is not touched (:func:`leave`)."""
    # One loop per case: a test of ``guard`` or ``bucket`` per request costs about a tenth of
    # the claim. ``filed[rid]``, not ``filed.get(rid)``: a subscript is one specialised
    # instruction where a call of ``get`` is three (about 80 instructions less per request);
    # a request filed nowhere there raises KeyError, which only a refused batch pays, and one
    # try around the loops costs nothing until then (one per request would).
    r = None
    try:
        if guard is not None:
            for r in reqs:
                if r.state is not src or filed[r.rid] is not r or (not guard(r)) is wanted:
                    return r
                r.state = dst
                r.timeline.append(entry)
                if bucket is not None:
                    bucket[r.rid] = r
        elif bucket is not None:
            for r in reqs:
                rid = r.rid
                if r.state is not src or filed[rid] is not r:
                    return r
                r.state = dst
                r.timeline.append(entry)
                bucket[rid] = r
        else:
            for r in reqs:
                if r.state is not src or filed[r.rid] is not r:
                    return r
                r.state = dst
                r.timeline.append(entry)
    except KeyError:
        # Refused by the lookup only if ``r`` is filed nowhere there: a KeyError that the
        # guard (called only for a request that is filed) raised is the guard's, and
        # propagates as a guard's exception does.
        if r is None or r.rid in filed:
            raise
        return r
    return None


def unclaim(
    reqs: Sequence[R],
    src: enum.IntEnum,
    dst: enum.IntEnum,
    bucket: dict[str, R] | None,
    entry: tuple[float, str],
) -> int:
    """Undo what :func:`claim` did to ``reqs`` with ``entry``: each claimed request is in
    ``src`` again, without ``entry``, and out of ``bucket``. Return how many were claimed."""
    undone = 0
    for r in reqs:
        timeline = r.timeline
        if r.state is dst and timeline and timeline[-1] is entry:
            timeline.pop()
            r.state = src
            if bucket is not None:
                del bucket[r.rid]
            undone += 1
    return undone


def leave(reqs: Sequence[R], src: dict[str, R], live: dict[str, R] | None) -> None:
    """Take a claimed batch out of its source bucket ``src``, and out of ``live`` (the live
    requests by id) when it entered a final state (``live`` given)."""
    if live is not None:
        for r in reqs:
            rid = r.rid
            del src[rid]
            del live[rid]
    elif len(src) == len(reqs):  # all of the bucket, in another order
        src.clear()
    else:
        for r in reqs:
            del src[r.rid]


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
