"""The Lifecycle machine: scenario walks asserting the whole state after each step, illegal
events (single and batch) raising and changing nothing, guards, and the trigger and batch
paths agreeing."""

from __future__ import annotations

import collections
import itertools
from typing import Any

import pytest

from lifecycle import (
    PREFILL_TABLE,
    FailureReason,
    GuardFailed,
    IllegalTransition,
    Lifecycle,
    LifecycleError,
    MissingHook,
    PrefillEvent,
    PrefillRequest,
    PrefillState,
)
from tests.strategies import prefill_request

P = PrefillState
Ev = PrefillEvent


class Clock:
    """A clock that moves one second per reading, so every step has its own time."""

    def __init__(self) -> None:
        self.ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self.ticks))


class Owner:
    """A lifecycle owner recording its hook calls (the boundary the KV layer sits behind)."""

    def __init__(self, check: bool = True) -> None:
        self.calls: list[tuple[str, str, P]] = []
        self.lc: Lifecycle[PrefillRequest] = Lifecycle(
            PREFILL_TABLE,
            {"release": self.hook("release"), "respond": self.hook("respond")},
            clock=Clock(),
            check=check,
        )

    def hook(self, name: str) -> Any:
        def run(req: PrefillRequest) -> None:
            assert req.state is not None
            self.calls.append((name, req.rid, req.state))

        return run

    def admit(self, *rids: str) -> list[PrefillRequest]:
        reqs = [prefill_request(rid) for rid in rids]
        for r in reqs:
            self.lc.admit(r)
        return reqs

    def state(self, reqs: list[PrefillRequest]) -> dict[str, Any]:
        """Everything observable, h11 style: assert this whole dict after each step."""
        return {
            "states": {r.rid: r.state for r in reqs},
            "counts": {s: n for s, n in self.lc.counts().items() if n},
            "live": len(self.lc),
            "finished": dict(+self.lc.finished),
            "hooks": list(self.calls),
            "timelines": {r.rid: [e for _, e in r.timeline] for r in reqs},
        }


def test_missing_hooks_are_refused_up_front() -> None:
    with pytest.raises(MissingHook, match=r"\['release', 'respond'\]"):
        Lifecycle(PREFILL_TABLE, {})


def test_happy_path_with_chunks_one_request_at_a_time() -> None:
    o = Owner()
    (a,) = reqs = o.admit("a")
    assert o.state(reqs) == {
        "states": {"a": P.BOOTSTRAPPING},
        "counts": {P.BOOTSTRAPPING: 1},
        "live": 1,
        "finished": {},
        "hooks": [],
        "timelines": {"a": ["admitted"]},
    }
    a.bootstrapped()
    a.schedule()
    assert o.state(reqs)["counts"] == {P.FORWARD: 1}
    a.computed = 4
    a.chunk_done()
    a.computed = 8
    a.prefilled()
    assert o.state(reqs) == {
        "states": {"a": P.TRANSFERRING},
        "counts": {P.TRANSFERRING: 1},
        "live": 1,
        "finished": {},
        "hooks": [],
        "timelines": {"a": ["admitted", "bootstrapped", "schedule", "chunk_done", "prefilled"]},
    }
    a.transferred()
    assert o.state(reqs) == {
        "states": {"a": P.DONE},
        "counts": {},
        "live": 0,
        "finished": {(P.DONE, None): 1},
        "hooks": [("release", "a", P.DONE), ("respond", "a", P.DONE)],
        "timelines": {
            "a": ["admitted", "bootstrapped", "schedule", "chunk_done", "prefilled", "transferred"]
        },
    }
    assert [t for t, _ in a.timeline] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert a.is_final and o.lc.get("a") is None and "a" not in o.lc


def test_batches_failures_and_aborts_in_mixed_states() -> None:
    o = Owner()
    reqs = o.admit("a", "b", "c", "d")
    a, b, c, d = reqs
    o.lc.fire(Ev.BOOTSTRAPPED, [a, b, c])
    assert o.state(reqs)["counts"] == {P.BOOTSTRAPPING: 1, P.WAITING: 3}
    assert list(o.lc.in_state(P.WAITING)) == ["a", "b", "c"]
    o.lc.fire(Ev.SCHEDULE, [b, c])
    d.abort("client went away", reason=FailureReason.ABORTED)
    assert o.state(reqs) == {
        "states": {"a": P.WAITING, "b": P.FORWARD, "c": P.FORWARD, "d": P.FAILED},
        "counts": {P.WAITING: 1, P.FORWARD: 2},
        "live": 3,
        "finished": {(P.FAILED, FailureReason.ABORTED): 1},
        "hooks": [("release", "d", P.FAILED), ("respond", "d", P.FAILED)],
        "timelines": {
            "a": ["admitted", "bootstrapped"],
            "b": ["admitted", "bootstrapped", "schedule"],
            "c": ["admitted", "bootstrapped", "schedule"],
            "d": ["admitted", "abort"],
        },
    }
    assert d.reason is FailureReason.ABORTED and d.detail == "client went away"
    o.lc.fail([c, a], FailureReason.TRANSFER_TIMEOUT, "deadline")
    assert o.state(reqs)["states"] == {
        "a": P.FAILED, "b": P.FORWARD, "c": P.FAILED, "d": P.FAILED,
    }
    assert o.state(reqs)["finished"] == {
        (P.FAILED, FailureReason.ABORTED): 1,
        (P.FAILED, FailureReason.TRANSFER_TIMEOUT): 2,
    }
    # fail() groups by state, in first-seen order: c (FORWARD) before a (WAITING).
    assert o.calls[2:] == [
        ("release", "c", P.FAILED), ("respond", "c", P.FAILED),
        ("release", "a", P.FAILED), ("respond", "a", P.FAILED),
    ]
    assert (a.reason, a.detail) == (FailureReason.TRANSFER_TIMEOUT, "deadline")
    assert o.lc.counts() == {P.BOOTSTRAPPING: 0, P.WAITING: 0, P.FORWARD: 1, P.TRANSFERRING: 0}


def test_illegal_single_events_raise_naming_request_state_event_and_change_nothing() -> None:
    o = Owner()
    reqs = o.admit("a")
    (a,) = reqs
    before = o.state(reqs)
    for event in ("schedule", "prefilled", "transferred", "chunk_done", "no_such_event"):
        with pytest.raises(IllegalTransition) as info:
            o.lc.trigger(a, event)
        assert (info.value.rid, info.value.state, info.value.event) == ("a", P.BOOTSTRAPPING, event)
        assert "request 'a' in state BOOTSTRAPPING cannot take event" in str(info.value)
        assert o.state(reqs) == before
    with pytest.raises(IllegalTransition):
        a.schedule()
    assert o.state(reqs) == before
    a.fail("too long", reason=FailureReason.REJECTED)
    after = o.state(reqs)
    for event in PREFILL_TABLE.events:  # final states are absorbing
        with pytest.raises(IllegalTransition):
            o.lc.trigger(a, event, reason=FailureReason.INTERNAL)
        with pytest.raises(IllegalTransition):
            o.lc.fire(event, [a], reason=FailureReason.INTERNAL)
    assert o.state(reqs) == after
    assert a.reason is FailureReason.REJECTED


def test_guards_choose_between_chunk_done_and_prefilled() -> None:
    o = Owner()
    reqs = o.admit("a", "b")
    a, b = reqs
    o.lc.fire(Ev.BOOTSTRAPPED, reqs)
    o.lc.fire(Ev.SCHEDULE, reqs)
    before = o.state(reqs)
    with pytest.raises(GuardFailed, match="fully_computed is false"):
        a.prefilled()
    with pytest.raises(GuardFailed, match="fully_computed is false"):
        o.lc.fire(Ev.PREFILLED, [a])
    a.computed = 8
    with pytest.raises(GuardFailed, match="fully_computed is true"):
        a.chunk_done()
    # One request of the batch fails its guard: the batch is refused, nobody moves.
    with pytest.raises(GuardFailed) as info:
        o.lc.fire(Ev.PREFILLED, [a, b])
    assert info.value.rid == "b"
    assert o.state(reqs) == before
    o.lc.fire(Ev.CHUNK_DONE, [b])
    b.computed = 8
    o.lc.fire(Ev.PREFILLED, [a, b])
    assert o.state(reqs)["counts"] == {P.TRANSFERRING: 2}


def test_batch_atomicity_mixed_states_duplicates_and_foreign_requests() -> None:
    o = Owner()
    other = Owner()
    reqs = o.admit("a", "b", "c")
    a, b, c = reqs
    (stranger,) = other.admit("s")
    o.lc.fire(Ev.BOOTSTRAPPED, [a, b])
    before = o.state(reqs)

    with pytest.raises(IllegalTransition) as info:  # c is still BOOTSTRAPPING
        o.lc.fire(Ev.SCHEDULE, [a, b, c])
    assert (info.value.rid, info.value.state) == ("c", P.BOOTSTRAPPING)
    assert "the batch is in state WAITING" in str(info.value)
    with pytest.raises(IllegalTransition):  # the first request decides the edge
        o.lc.fire(Ev.BOOTSTRAPPED, [c, a])
    with pytest.raises(LifecycleError, match="appears twice"):
        o.lc.fire(Ev.SCHEDULE, [a, b, a])
    with pytest.raises(LifecycleError, match="belongs to another lifecycle"):
        o.lc.fire(Ev.BOOTSTRAPPED, [c, stranger])
    with pytest.raises(LifecycleError, match="belongs to another lifecycle"):
        o.lc.trigger(stranger, Ev.BOOTSTRAPPED)
    with pytest.raises(LifecycleError, match="never admitted"):
        prefill_request("loose").bootstrapped()
    assert o.state(reqs) == before
    assert other.state([stranger])["states"] == {"s": P.BOOTSTRAPPING}
    o.lc.fire(Ev.SCHEDULE, [])  # an empty batch is a no-op
    assert o.state(reqs) == before


def test_admission_refuses_duplicates_and_tracked_requests() -> None:
    o = Owner()
    reqs = o.admit("a")
    before = o.state(reqs)
    with pytest.raises(LifecycleError, match="'a' is already live"):
        o.lc.admit(prefill_request("a"))
    with pytest.raises(LifecycleError, match="'a' is already tracked by this lifecycle"):
        o.lc.admit(reqs[0])
    with pytest.raises(LifecycleError, match="'a' is already tracked by another lifecycle"):
        Owner().lc.admit(reqs[0])
    assert o.state(reqs) == before


def _walk(fire_one: bool) -> tuple[list[list[tuple[float, str]]], list[tuple[str, str, P]]]:
    o = Owner()
    reqs = o.admit("a", "b", "c")
    a, b, c = reqs

    def fire(event: PrefillEvent, batch: list[PrefillRequest], **kw: Any) -> None:
        if fire_one:
            for r in batch:
                o.lc.trigger(r, event, **kw)
        else:
            o.lc.fire(event, batch, **kw)

    fire(Ev.BOOTSTRAPPED, [a, b, c])
    fire(Ev.SCHEDULE, [a, b])
    fire(Ev.ABORT, [c], reason=FailureReason.ABORTED)
    a.computed = b.computed = 8
    fire(Ev.PREFILLED, [a, b])
    fire(Ev.TRANSFERRED, [a])
    fire(Ev.FAIL, [b], reason=FailureReason.TRANSFER_FAILED)
    assert collections.Counter(r.reason for r in reqs) == {
        None: 1, FailureReason.ABORTED: 1, FailureReason.TRANSFER_FAILED: 1
    }
    return [r.timeline for r in reqs], o.calls


def test_trigger_path_and_batch_path_give_the_same_timelines_and_hooks() -> None:
    one_by_one = _walk(fire_one=True)
    batched = _walk(fire_one=False)
    # Events and hooks agree exactly; times differ only because a batch reads the clock once.
    assert [[e for _, e in t] for t in one_by_one[0]] == [[e for _, e in t] for t in batched[0]]
    assert one_by_one[1] == batched[1]


def test_check_index_catches_a_request_filed_under_the_wrong_state() -> None:
    o = Owner(check=False)
    (a,) = o.admit("a")
    a.state = P.WAITING  # corrupt the record behind the lifecycle's back
    with pytest.raises(AssertionError, match="'a' filed under BOOTSTRAPPING"):
        o.lc.check_index()
