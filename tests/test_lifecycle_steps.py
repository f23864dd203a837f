"""The shared ``transitions`` machine of a table (lifecycle/steps.py): it finds states as the
library does, the one-request path executes the table's own ``transitions.Transition``, and a
batch shares one timeline entry."""

from __future__ import annotations

import enum
import logging
from typing import Any, ClassVar

import attrs
import pytest
from transitions import Machine

from lifecycle import (
    DecodeRequest,
    Edge,
    Lifecycle,
    PrefillRequest,
    SamplingParams,
    Tracked,
    Trigger,
    make_table,
    shared_machine,
)


class S(enum.IntEnum):
    CLOSED = 0
    NEW = 1
    OPEN = 2


class E(enum.StrEnum):
    OPEN = "open"
    CLOSE = "close"


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Ticket(Tracked):
    open: ClassVar[Trigger]
    close: ClassVar[Trigger]


TABLE = make_table(
    "tickets",
    S,
    events=E,
    initial=S.NEW,
    finals=(S.CLOSED,),
    edges=(
        Edge(E.OPEN, S.NEW, S.OPEN),
        Edge(E.CLOSE, S.NEW, S.CLOSED),
        Edge(E.CLOSE, S.OPEN, S.CLOSED),
    ),
    failure_events=(E.CLOSE,),
    record=Ticket,
)


def test_the_shared_machine_finds_states_as_the_library_does() -> None:
    machine = shared_machine(TABLE)
    assert shared_machine(TABLE) is machine
    for member in S:
        state = machine.get_state(member)
        assert state is machine.get_state(member.name)
        assert state is Machine.get_state(machine, member)  # the library's own lookup
        assert state.name == member.name
        assert state.value is member
    with pytest.raises(ValueError, match="'LOST' is not a registered state"):
        machine.get_state("LOST")


def test_one_request_moves_through_the_tables_transition() -> None:
    machine = shared_machine(TABLE)
    (transition,) = machine.events["open"].transitions["NEW"]
    seen: list[tuple[str, Any]] = []

    def after(event_data: Any) -> None:
        seen.append((event_data.model.rid, event_data.model.state))

    transition.after.append(after)
    try:
        lc: Lifecycle[Ticket] = Lifecycle(TABLE)
        a = Ticket("a")
        lc.admit(a)
        a.open()
    finally:
        transition.after.remove(after)
    # The library set the state; the lifecycle then moved the index and the timeline.
    assert seen == [("a", S.OPEN)]
    assert dict(lc.in_state(S.OPEN)) == {"a": a}
    assert [event for _, event in a.timeline] == ["admitted", "open"]
    a.close()
    assert seen == [("a", S.OPEN)]  # the callback was removed: the machine has none of its own
    assert a.state is S.CLOSED and len(lc) == 0


@pytest.mark.parametrize("where", ["machine after", "state enter", "state exit", "prepare"])
def test_a_callback_added_anywhere_the_library_calls_one_runs(where: str) -> None:
    """With nothing of the library's to run, the table's transition sets the state without
    its callback loops; a callback added to the machine, a state or the transition itself
    makes it run the library's execute again, which calls it."""
    machine = shared_machine(TABLE)
    (transition,) = machine.events["open"].transitions["NEW"]
    seen: list[tuple[str, Any]] = []

    def callback(event_data: Any) -> None:
        seen.append((event_data.model.rid, event_data.model.state))

    callbacks = {
        "machine after": machine.after_state_change,
        "state enter": machine.get_state(S.OPEN).on_enter,
        "state exit": machine.get_state(S.NEW).on_exit,
        "prepare": transition.prepare,
    }[where]
    lc: Lifecycle[Ticket] = Lifecycle(TABLE)
    a, b = Ticket("a"), Ticket("b")
    lc.admit(a)
    lc.admit(b)
    a.open()  # no callback: the short path
    callbacks.append(callback)
    try:
        b.open()
    finally:
        callbacks.remove(callback)
    # prepare and exit run before the state changes, after and enter once it changed.
    assert seen == [("b", S.NEW if where in ("state exit", "prepare") else S.OPEN)]
    assert (a.state, b.state) == (S.OPEN, S.OPEN)
    assert dict(lc.in_state(S.OPEN)) == {"a": a, "b": b}
    assert [event for _, event in b.timeline] == ["admitted", "open"]


def test_the_librarys_log_switched_on_shows_each_transition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lc: Lifecycle[Ticket] = Lifecycle(TABLE)
    a, b = Ticket("a"), Ticket("b")
    lc.admit(a)
    lc.admit(b)
    with caplog.at_level(logging.DEBUG, logger="transitions.core"):
        a.open()
    assert any("Initiating transition from state NEW to state OPEN" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    b.open()  # the logger is quiet again: the short path logs nothing
    assert not [r for r in caplog.records if r.name == "transitions.core"]
    assert (a.state, b.state) == (S.OPEN, S.OPEN)


def test_a_batch_shares_one_timeline_entry() -> None:
    times = iter([1.0, 2.0, 3.0])
    lc: Lifecycle[Ticket] = Lifecycle(TABLE, clock=lambda: next(times))
    a, b = Ticket("a"), Ticket("b")
    lc.admit(a)
    lc.admit(b)
    lc.fire(E.OPEN, [a, b])
    assert a.timeline == [(1.0, "admitted"), (3.0, "open")]
    assert b.timeline == [(2.0, "admitted"), (3.0, "open")]
    assert a.timeline[-1] is b.timeline[-1]  # one immutable entry for the batch


def test_records_share_the_default_sampling_params() -> None:
    # Frozen, so one instance serves every request that asks for nothing.
    assert PrefillRequest("a").sampling is PrefillRequest("b").sampling
    assert PrefillRequest("a").sampling is DecodeRequest("c").sampling
    assert PrefillRequest("a").sampling == SamplingParams()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        PrefillRequest("a").sampling.max_new_tokens = 1  # type: ignore[misc]
