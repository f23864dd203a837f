"""The shared ``transitions`` machine of a table (lifecycle/steps.py): it finds states as the
library does, the one-request path executes the table's own ``transitions.Transition``, the
machine takes no callbacks, and a batch shares one timeline entry."""

from __future__ import annotations

import enum
import gc
import logging
import weakref
from typing import Any, ClassVar

import attrs
import pytest
from transitions import Machine

from lifecycle import (
    DecodeRequest,
    Edge,
    Lifecycle,
    LifecycleError,
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
    lc: Lifecycle[Ticket] = Lifecycle(TABLE)
    a = Ticket("a")
    lc.admit(a)
    a.open()
    # The library's transition set the state; the lifecycle then moved the index and timeline.
    assert transition.dest_state is machine.get_state(S.OPEN)
    assert dict(lc.in_state(S.OPEN)) == {"a": a}
    assert [event for _, event in a.timeline] == ["admitted", "open"]
    a.close()
    assert a.state is S.CLOSED and len(lc) == 0


def _callback(event_data: Any) -> None:
    raise AssertionError("a callback of the shared machine ran")


class Model:
    state = S.NEW


def _add_to_on_enter(state: Any) -> None:
    state.on_enter += [_callback]


ADDITIONS: dict[str, Any] = {
    "machine after_state_change": lambda m, t: m.after_state_change.append(_callback),
    "machine after_state_change =": lambda m, t: setattr(m, "after_state_change", _callback),
    "machine before_state_change": lambda m, t: m.before_state_change.append(_callback),
    "machine on_final": lambda m, t: m.on_final.append(_callback),
    "machine on_exception": lambda m, t: m.on_exception.append(_callback),
    "machine prepare_event": lambda m, t: m.prepare_event.append(_callback),
    "machine finalize_event": lambda m, t: m.finalize_event.append(_callback),
    "state enter": lambda m, t: m.get_state(S.OPEN).add_callback("enter", _callback),
    "state exit": lambda m, t: m.get_state(S.NEW).add_callback("exit", _callback),
    "on_enter_OPEN": lambda m, t: m.on_enter_OPEN(_callback),
    "state on_exit =": lambda m, t: setattr(m.get_state(S.NEW), "on_exit", [_callback]),
    "state on_enter +=": lambda m, t: _add_to_on_enter(m.get_state(S.OPEN)),
    "event before": lambda m, t: m.before_open(_callback),
    "transition prepare": lambda m, t: t.prepare.append(_callback),
    "transition after": lambda m, t: t.add_callback("after", _callback),
    "transition conditions": lambda m, t: t.conditions.extend([_callback]),
    "transition before =": lambda m, t: setattr(t, "before", [_callback]),
    "add_transition": lambda m, t: m.add_transition("open", S.OPEN, S.NEW),
    "remove_transition": lambda m, t: m.remove_transition("open"),
    "add_states": lambda m, t: m.add_states("LOST"),
    "add_model": lambda m, t: m.add_model(Model()),
}


@pytest.mark.parametrize("where", sorted(ADDITIONS))
def test_the_shared_machine_takes_no_callbacks(where: str) -> None:
    """A lifecycle runs the table's hooks, and nothing else, on both firing paths: a callback
    added to the shared machine is refused where it is added (it used to run on the
    one-request path only, and one that raised left the state set but not the index)."""
    machine = shared_machine(TABLE)
    (transition,) = machine.events["open"].transitions["NEW"]
    with pytest.raises(LifecycleError, match=(
            r"^tickets: the table's shared transitions machine takes no callbacks, transitions, "
            r"states or models \(.+\): a lifecycle runs the table's hooks and nothing else")):
        ADDITIONS[where](machine, transition)
    assert not machine.after_state_change and not machine.get_state(S.OPEN).on_enter
    assert not transition.prepare and not transition.after and not transition.conditions
    assert list(machine.events["open"].transitions) == ["NEW"] and not machine.models
    lc: Lifecycle[Ticket] = Lifecycle(TABLE)
    a, b = Ticket("a"), Ticket("b")
    lc.admit(a)
    lc.admit(b)
    a.open()
    lc.fire(E.OPEN, [b])
    assert (a.state, b.state) == (S.OPEN, S.OPEN)
    assert dict(lc.in_state(S.OPEN)) == {"a": a, "b": b}
    lc.check_index()


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


def _run_time_table() -> tuple[weakref.ref[Any], ...]:
    """A table, its record class and a hook built at run time and used once; weak references
    to what must not outlive them."""

    @attrs.define(slots=True, eq=False)
    class Job(Tracked):
        def ready(self) -> bool:
            return True

    def notify(job: Job) -> None:
        pass

    table = make_table(
        "jobs", S, events=E, initial=S.NEW, finals=(S.CLOSED,),
        edges=(Edge(E.OPEN, S.NEW, S.OPEN, conditions="ready"),
               Edge(E.CLOSE, S.NEW, S.CLOSED), Edge(E.CLOSE, S.OPEN, S.CLOSED)),
        failure_events=(E.CLOSE,), on_enter={S.CLOSED: "notify"}, record=Job)
    lc: Lifecycle[Job] = Lifecycle(table, {"notify": notify})
    a, b = Job("a"), Job("b")
    lc.admit(a)
    lc.admit(b)
    a.fire(E.OPEN)
    lc.fire(E.CLOSE, [a])
    lc.fail([b], None)
    return weakref.ref(table), weakref.ref(shared_machine(table)), weakref.ref(notify)


def test_a_table_built_at_run_time_takes_its_machine_with_it() -> None:
    """What the lifecycle derives from a table or a hook (the table's machine, the hook's form)
    is kept while they live, and no longer: tables built at run time do not accumulate."""
    refs = [_run_time_table() for _ in range(3)]
    gc.collect()
    assert [[r() for r in made] for made in refs] == [[None, None, None]] * 3


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
