"""The state index under batch moves: a batch that is a whole bucket (in its order) moves the
bucket at once, any other batch request by request, and both leave the same index, timelines and
counts; each walk asserts the whole index (bucket contents in order) after every step."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from lifecycle import (
    PREFILL_TABLE,
    FailureReason,
    IllegalTransition,
    Lifecycle,
    LifecycleError,
    PrefillEvent,
    PrefillRequest,
    PrefillState,
)
from tests.strategies import prefill_request

P = PrefillState
Ev = PrefillEvent


def _lifecycle(calls: list[tuple[str, str]]) -> Lifecycle[PrefillRequest]:
    ticks = itertools.count()
    return Lifecycle(
        PREFILL_TABLE,
        {
            "release": lambda r: calls.append(("release", r.rid)),
            "respond": lambda r: calls.append(("respond", r.rid)),
        },
        clock=lambda: float(next(ticks)),
        check=True,  # invariant 4 after every move
    )


def _index(lc: Lifecycle[PrefillRequest]) -> dict[P, list[str]]:
    """Every non-empty bucket, its request ids in order."""
    return {s: list(lc.in_state(s)) for s in P if s in lc.counts() and lc.in_state(s)}


def _admit(lc: Lifecycle[PrefillRequest], *rids: str) -> list[PrefillRequest]:
    reqs = [prefill_request(rid) for rid in rids]
    for r in reqs:
        lc.admit(r)
    return reqs


def test_a_whole_bucket_lands_after_what_its_destination_holds() -> None:
    calls: list[tuple[str, str]] = []
    lc = _lifecycle(calls)
    a, b, c, d = _admit(lc, "a", "b", "c", "d")
    lc.fire(Ev.BOOTSTRAPPED, [a])
    assert _index(lc) == {P.BOOTSTRAPPING: ["b", "c", "d"], P.WAITING: ["a"]}
    lc.fire(Ev.BOOTSTRAPPED, [b, c, d])  # the whole bucket, in its order
    assert _index(lc) == {P.WAITING: ["a", "b", "c", "d"]}
    assert b.timeline[-1] is c.timeline[-1] is d.timeline[-1] == (5.0, "bootstrapped")
    lc.fire(Ev.SCHEDULE, [a, b, c, d])
    for r in (a, b, c, d):
        r.computed = len(r.input_ids)
    lc.fire(Ev.PREFILLED, [a, b, c, d])
    assert _index(lc) == {P.TRANSFERRING: ["a", "b", "c", "d"]}
    lc.fire(Ev.TRANSFERRED, [a, b, c, d])
    assert _index(lc) == {} and len(lc) == 0
    assert {r.state for r in (a, b, c, d)} == {P.DONE}
    assert lc.finished == {(P.DONE, None): 4}
    assert calls == [(h, r) for r in "abcd" for h in ("release", "respond")]


@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_bucket_in_another_order_or_as_a_tuple_moves_in_batch_order(as_tuple: bool) -> None:
    lc = _lifecycle([])
    a, b, c = _admit(lc, "a", "b", "c")
    batch: Sequence[PrefillRequest] = (c, a, b) if as_tuple else [c, a, b]
    lc.fire(Ev.BOOTSTRAPPED, batch)
    assert _index(lc) == {P.WAITING: ["c", "a", "b"]}
    batch = (c, a, b) if as_tuple else [c, a, b]  # now the whole bucket, in its order
    lc.fire(Ev.SCHEDULE, batch)
    assert _index(lc) == {P.FORWARD: ["c", "a", "b"]}
    assert [e for _, e in a.timeline] == ["admitted", "bootstrapped", "schedule"]


def test_chunk_done_on_a_whole_bucket_keeps_its_order_and_on_part_of_it_moves_that_last() -> None:
    lc = _lifecycle([])
    reqs = _admit(lc, "a", "b", "c")
    a, _, c = reqs
    lc.fire(Ev.BOOTSTRAPPED, reqs)
    lc.fire(Ev.SCHEDULE, reqs)
    lc.fire(Ev.CHUNK_DONE, reqs)  # a self-loop of the whole bucket
    assert _index(lc) == {P.FORWARD: ["a", "b", "c"]}
    assert [e for _, e in c.timeline][-1] == "chunk_done"
    lc.fire(Ev.CHUNK_DONE, [a])  # part of the bucket: it goes to the back, as one by one
    assert _index(lc) == {P.FORWARD: ["b", "c", "a"]}
    c.chunk_done()
    assert _index(lc) == {P.FORWARD: ["b", "a", "c"]}


def test_a_refused_batch_the_size_of_its_bucket_changes_nothing() -> None:
    lc = _lifecycle([])
    a, b = _admit(lc, "a", "b")
    (stranger,) = _admit(_lifecycle([]), "s")
    before = (_index(lc), [list(r.timeline) for r in (a, b)])
    with pytest.raises(LifecycleError, match="appears twice"):
        lc.fire(Ev.BOOTSTRAPPED, [a, a])
    with pytest.raises(LifecycleError, match="belongs to another lifecycle"):
        lc.fire(Ev.BOOTSTRAPPED, [a, stranger])
    assert (_index(lc), [list(r.timeline) for r in (a, b)]) == before
    assert before[0] == {P.BOOTSTRAPPING: ["a", "b"]}
    lc.fire(Ev.BOOTSTRAPPED, [a])
    with pytest.raises(IllegalTransition):  # one bucket's size, two states
        lc.fire(Ev.BOOTSTRAPPED, [b, a])
    assert _index(lc) == {P.BOOTSTRAPPING: ["b"], P.WAITING: ["a"]}
    lc.fire(Ev.BOOTSTRAPPED, [b])
    assert _index(lc) == {P.WAITING: ["a", "b"]}


def test_a_batch_into_a_final_state_is_counted_by_the_reason_each_holds() -> None:
    lc = _lifecycle([])
    reqs = _admit(lc, "a", "b", "c", "d")
    lc.fire(Ev.BOOTSTRAPPED, reqs)
    reqs[1].reason = FailureReason.ABORTED  # held before the event: it ends with it
    reqs[3].reason = FailureReason.ABORTED
    lc.fire(Ev.FAIL, reqs)
    assert lc.finished == {(P.FAILED, None): 2, (P.FAILED, FailureReason.ABORTED): 2}
    assert _index(lc) == {} and len(lc) == 0
