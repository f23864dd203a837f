"""The state index under batch moves: a batch that is a whole bucket (in its order) moves the
bucket at once, any other batch request by request, and both leave the same index, timelines and
counts; each walk asserts the whole index (bucket contents in order) after every step."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import pytest

from lifecycle import (
    PREFILL_TABLE,
    FailureReason,
    GuardFailed,
    HookFailed,
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


# -- part of a bucket: claimed request by request, undone on a refusal -------------------------


def _whole_state(lc: Lifecycle[PrefillRequest], reqs: Sequence[PrefillRequest]) -> object:
    """Everything a refused batch must leave as it was: the index in order, the live requests,
    each request's state and timeline, and the counters."""
    return (
        _index(lc),
        list(lc.live()),
        [(r.state, list(r.timeline)) for r in reqs],
        lc.transitions_fired,
        dict(lc.finished),
        lc.guards_evaluated,
    )


def _forward(lc: Lifecycle[PrefillRequest], *rids: str) -> list[PrefillRequest]:
    """``rids`` admitted, bootstrapped and scheduled into FORWARD, one batch."""
    reqs = _admit(lc, *rids)
    lc.fire(Ev.BOOTSTRAPPED, reqs)
    lc.fire(Ev.SCHEDULE, reqs)
    return reqs


def test_part_of_a_bucket_is_claimed_in_batch_order_after_what_its_destination_holds() -> None:
    calls: list[tuple[str, str]] = []
    lc = _lifecycle(calls)
    a, b, c, d, e = _forward(lc, "a", "b", "c", "d", "e")
    for r in (a, b, c, d, e):
        r.computed = len(r.input_ids)
    lc.fire(Ev.PREFILLED, [b])
    lc.fire(Ev.PREFILLED, [d, a])  # part of FORWARD, guarded, out of order
    assert _index(lc) == {P.FORWARD: ["c", "e"], P.TRANSFERRING: ["b", "d", "a"]}
    assert lc.guards_evaluated == 3
    assert a.timeline[-1] is d.timeline[-1] and a.timeline[-1][1] == "prefilled"
    lc.fire(Ev.PREFILLED, [c, e])
    lc.fire(Ev.TRANSFERRED, [a, c])  # part of TRANSFERRING into a final state
    assert _index(lc) == {P.TRANSFERRING: ["b", "d", "e"]}
    assert [r.rid for r in lc.live()] == ["b", "d", "e"]
    assert a.state is c.state is P.DONE and lc.finished == {(P.DONE, None): 2}
    assert calls == [(h, r) for r in "ac" for h in ("release", "respond")]


@pytest.mark.parametrize("culprit", ["wrong state", "twice", "stranger", "never admitted"])
def test_a_refused_part_of_a_bucket_changes_nothing(culprit: str) -> None:
    lc = _lifecycle([])
    reqs = _admit(lc, "a", "b", "c", "d", "e")
    a, b, c, d, _ = reqs
    lc.fire(Ev.BOOTSTRAPPED, [d])
    (stranger,) = _admit(_lifecycle([]), "s")
    bad = {
        "wrong state": d,
        "twice": a,
        "stranger": stranger,
        "never admitted": prefill_request("n"),
    }[culprit]
    before = _whole_state(lc, [*reqs, bad])
    error, says = {
        "wrong state": (IllegalTransition, "the batch is in state BOOTSTRAPPING"),
        "twice": (LifecycleError, "appears twice"),
        "stranger": (LifecycleError, "belongs to another lifecycle"),
        "never admitted": (LifecycleError, "'n' was never admitted to a lifecycle"),
    }[culprit]
    with pytest.raises(error, match=says):
        lc.fire(Ev.BOOTSTRAPPED, [a, b, bad, c])
    assert _whole_state(lc, [*reqs, bad]) == before
    assert before[0] == {P.BOOTSTRAPPING: ["a", "b", "c", "e"], P.WAITING: ["d"]}
    lc.fire(Ev.BOOTSTRAPPED, [a, b, c])  # and the same batch without it fires
    assert _index(lc) == {P.BOOTSTRAPPING: ["e"], P.WAITING: ["d", "a", "b", "c"]}


def test_a_guard_refusing_part_of_a_bucket_changes_nothing_but_the_evaluations() -> None:
    lc = _lifecycle([])
    reqs = _forward(lc, "a", "b", "c", "d")
    a, b, c, _ = reqs
    a.computed = c.computed = len(a.input_ids)  # b is not fully computed
    before = _whole_state(lc, reqs)
    with pytest.raises(GuardFailed, match="fully_computed is false") as refused:
        lc.fire(Ev.PREFILLED, [a, b, c])
    assert refused.value.rid == "b"
    assert lc.guards_evaluated == 2  # a and b, once each; c never
    assert _whole_state(lc, reqs)[:-1] == before[:-1]
    # A batch refused whatever the guard says is refused as such, as before any guard ran.
    (stranger,) = _admit(_lifecycle([]), "s")
    with pytest.raises(IllegalTransition, match="the batch is in state FORWARD") as illegal:
        lc.fire(Ev.PREFILLED, [a, b, stranger])
    assert not isinstance(illegal.value, GuardFailed) and illegal.value.rid == "s"
    assert _whole_state(lc, reqs)[:-1] == before[:-1]


def test_a_guard_raising_on_part_of_a_bucket_changes_nothing() -> None:
    lc = _lifecycle([])
    reqs = _forward(lc, "a", "b", "c", "d")
    for r in reqs:
        r.computed = len(r.input_ids)
    reqs[1].input_ids = None  # type: ignore[assignment]  # len(None) raises in the guard
    before = _whole_state(lc, reqs)
    with pytest.raises(TypeError):
        lc.fire(Ev.PREFILLED, reqs[:3])
    assert lc.guards_evaluated == 2
    assert _whole_state(lc, reqs)[:-1] == before[:-1]


@attrs.define(slots=True, eq=False, weakref_slot=False)
class _LookupGuardRequest(PrefillRequest):
    """A record whose guard looks itself up in a dict, and raises KeyError for 'b'."""

    def fully_computed(self) -> bool:
        return {"a": True, "c": True, "d": True}[self.rid]


def test_a_guard_raising_key_error_on_part_of_a_bucket_is_the_guards_exception() -> None:
    # The claim reads the source bucket by subscript, and a KeyError there means the request
    # is not filed: one raised by a guard of a filed request must still propagate as the
    # guard's, with nothing changed, not be taken for a request filed nowhere.
    lc = _lifecycle([])
    reqs = [_LookupGuardRequest(rid, input_ids=[1, 2]) for rid in "abcd"]
    for r in reqs:
        lc.admit(r)
    lc.fire(Ev.BOOTSTRAPPED, reqs)
    lc.fire(Ev.SCHEDULE, reqs)
    before = _whole_state(lc, reqs)
    with pytest.raises(KeyError, match="'b'"):
        lc.fire(Ev.PREFILLED, reqs[:3])
    assert lc.guards_evaluated == 2  # a, then b's raised
    assert _whole_state(lc, reqs)[:-1] == before[:-1]
    lc.fire(Ev.PREFILLED, [reqs[0], reqs[2]])  # part of the bucket, the guard answering
    assert _index(lc) == {P.FORWARD: ["b", "d"], P.TRANSFERRING: ["a", "c"]}


@attrs.define(slots=True, eq=False, weakref_slot=False)
class _OtherRequest(PrefillRequest):
    """A second record class: with two admitted, a batch's guard is looked up per request."""

    def fully_computed(self) -> bool:
        return True


def test_two_record_classes_each_get_their_own_guard() -> None:
    lc = _lifecycle([])
    (a,) = _forward(lc, "a")
    other = _OtherRequest("o", input_ids=[1, 2, 3])
    lc.admit(other)
    lc.fire(Ev.BOOTSTRAPPED, [other])
    lc.fire(Ev.SCHEDULE, [other])
    _forward(lc, "z")
    with pytest.raises(GuardFailed) as refused:  # a's own guard: not computed
        lc.fire(Ev.PREFILLED, [other, a])
    assert refused.value.rid == "a"
    lc.fire(Ev.PREFILLED, [other])  # its guard says yes without anything computed
    assert _index(lc) == {P.FORWARD: ["a", "z"], P.TRANSFERRING: ["o"]}


def test_a_raising_hook_of_two_stops_neither_for_any_request() -> None:
    calls: list[tuple[str, str]] = []

    def respond(r: PrefillRequest) -> None:
        calls.append(("respond", r.rid))
        if r.rid == "b":
            raise RuntimeError("the client is gone")

    lc = Lifecycle(
        PREFILL_TABLE, {"release": lambda r: calls.append(("release", r.rid)), "respond": respond}
    )
    reqs = _admit(lc, "a", "b", "c")
    with pytest.raises(HookFailed) as info:
        lc.fire(Ev.FAIL, reqs[1:])  # part of the bucket
    assert [(rid, hook) for rid, hook, _ in info.value.errors] == [("b", "respond")]
    lc.fire(Ev.FAIL, reqs[:1])  # the whole bucket
    assert calls == [(h, r) for r in "bca" for h in ("release", "respond")]
    assert _index(lc) == {} and {r.state for r in reqs} == {P.FAILED}
    assert lc.finished == {(P.FAILED, None): 3}
