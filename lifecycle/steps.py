"""The shared ``transitions`` machine of a table, and each edge as a lifecycle fires it.

A table has one ``transitions.Machine`` (:func:`shared_machine`), shared by every
:class:`~lifecycle.machine.Lifecycle` on it: no model is added to it, and it has no callbacks,
conditions or automatic transitions; it holds the states and transitions, and the trigger path
executes the edge's ``transitions.Transition`` on it to set a request's state. A
:class:`Step` is one edge as one lifecycle fires it, with everything firing needs looked up
once, when the lifecycle is built.

The machine's classes are the library's with three changes that keep its behaviour and drop
work it would do for nothing (the library's ``Transition.execute`` was most of the one-request
path's cost): a state reads its enum member's name once; a state is found by member or name in
one dict lookup; and a transition with nothing of the library's to run — no callback or
condition on it, its states or the machine, and the library's logger quiet — sets the model's
state through the machine's ``set_state`` without the library's eight logging calls and empty
callback loops. Add a callback (or switch on ``transitions``' logging) and that transition runs
the library's full ``execute`` again.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from transitions import Machine
from transitions.core import Event, EventData, State, Transition

from lifecycle.binding import Firing
from lifecycle.errors import LifecycleError
from lifecycle.record import Tracked
from lifecycle.table import Edge, LifecycleTable

R = TypeVar("R", bound=Tracked)
#: A hook: ``hook(req)`` or ``hook(req, event)`` (``event`` is a :class:`Firing`).
Hook = Callable[..., None]

# id(table) -> (table, machine). Holding the table keeps it alive, so its id cannot be reused
# by a later table (which would otherwise be handed this table's machine).
_MACHINES: dict[int, tuple[LifecycleTable, Machine]] = {}


def shared_machine(table: LifecycleTable) -> Machine:
    """The one ``transitions.Machine`` of ``table`` (built on first use)."""
    entry = _MACHINES.get(id(table))
    if entry is not None:
        return entry[1]
    machine = _TableMachine(
        model=None,
        states=table.states,
        transitions=[
            {"trigger": str(e.event), "source": e.source, "dest": e.dest} for e in table.edges
        ],
        initial=None,
        auto_transitions=False,
        send_event=True,
    )
    _MACHINES[id(table)] = (table, machine)
    return machine


class _NamedState(State):
    """A transitions State that reads its enum member's name once: ``State.name`` recomputes
    it on every access, and the library reads it several times per transition (its logging
    arguments are built whether or not anything is logged)."""

    def __init__(self, name: str | enum.Enum, *args: Any, **kwargs: Any) -> None:
        super().__init__(name, *args, **kwargs)
        self._plain_name: str = name.name if isinstance(name, enum.Enum) else name

    @property
    def name(self) -> str:
        return self._plain_name


#: The library's own logger: while it logs its transitions, they run the library's execute.
_LIBRARY_LOG = logging.getLogger("transitions.core")


class _TableTransition(Transition):
    """A transitions Transition whose execute skips what would do nothing: when nothing of the
    library's would run (see the module docstring), it sets the state as the library would
    (``Machine.set_state``, then the event data's state) and reports success; otherwise it is
    the library's ``execute``."""

    def execute(self, event_data: EventData) -> bool:
        machine = event_data.machine
        dest_name = self.dest  # None: an internal transition (the tables have none)
        if (
            dest_name is None
            or self.prepare
            or self.conditions
            or self.before
            or self.after
            or machine.before_state_change
            or machine.after_state_change
            or _LIBRARY_LOG.isEnabledFor(logging.INFO)
        ):
            return bool(super().execute(event_data))
        dest = machine.get_state(dest_name)
        if (
            dest.on_enter
            or machine.get_state(self.source).on_exit
            or (dest.final and machine.on_final)
        ):
            return bool(super().execute(event_data))
        machine.set_state(dest, event_data.model)
        event_data.state = dest
        return True


class _TableMachine(Machine):
    """The shared machine: transitions' Machine with the state and transition classes above,
    and a state lookup that finds an enum member or a name in one dict lookup (the library
    turns a member into its name first, which costs more than the lookup)."""

    state_cls = _NamedState
    transition_cls = _TableTransition
    _by_key: Mapping[str | enum.Enum, State] = {}

    def add_states(self, states: Any, *args: Any, **kwargs: Any) -> None:
        super().add_states(states, *args, **kwargs)
        by_key: dict[str | enum.Enum, State] = {}
        for name, state in self.states.items():
            by_key[name] = by_key[state.value] = state
        self._by_key = by_key

    def get_state(self, state: str | enum.Enum) -> State:
        found = self._by_key.get(state)
        return found if found is not None else super().get_state(state)


#: A guard as a step calls it on one record class: its name, the function, whether it takes the
#: event, and the answer that lets the edge fire (True for ``conditions``, False for ``unless``).
GuardCall = tuple[str, Callable[..., Any], bool, bool]


class Step(Generic[R]):
    """One edge as one lifecycle fires it: the edge, its guards and hooks, the index buckets it
    moves requests between, and the shared machine's objects for it (the trigger path)."""

    __slots__ = (
        "dst_bucket",
        "edge",
        "failure",
        "final",
        "fired",
        "firing",
        "guard_calls",
        "guards",
        "hooks",
        "machine_event",
        "machine_source",
        "src_bucket",
        "transition",
    )

    def __init__(
        self,
        edge: Edge,
        machine: Machine,
        src_bucket: dict[str, R],
        dst_bucket: dict[str, R] | None,
        hooks: tuple[tuple[str, Hook, bool], ...],
        *,
        failure: bool = False,
    ) -> None:
        self.edge = edge
        #: Whether the edge leads to a failure state (one a failure event leads to): a failure
        #: reason goes with it.
        self.failure = failure
        #: How many requests took this edge (``Lifecycle.fired_by_event`` sums them).
        self.fired = 0
        #: The Firing of an event fired without a reason or detail (the common case).
        self.firing = Firing(edge.event, edge.source, edge.dest)
        self.guards: tuple[tuple[str, bool], ...] = (
            *((g, True) for g in edge.conditions),
            *((g, False) for g in edge.unless),
        )
        #: Per record class bound to the lifecycle, the guards as they are called
        #: (:meth:`bind`): the functions are looked up once, not per request fired at.
        self.guard_calls: dict[type, tuple[GuardCall, ...]] = {}
        self.hooks = hooks
        self.src_bucket = src_bucket
        #: None for a final destination: the request leaves the index.
        self.dst_bucket = dst_bucket
        self.final = dst_bucket is None
        self.machine_event: Event = machine.events[str(edge.event)]
        self.machine_source: State = machine.get_state(edge.source)
        (self.transition,) = self.machine_event.transitions[edge.source.name]
        assert isinstance(self.transition, Transition)

    def fired_with(self, reason: enum.Enum | None, detail: str, table: LifecycleTable) -> Firing:
        """The Firing of this edge fired with ``reason`` and ``detail``, which only an edge into
        a final state takes; ``reason``, of the table's reasons enum, only an edge into a
        failure state (one a failure event leads to)."""
        edge = self.edge
        if (reason is not None or detail) and not self.final:
            raise LifecycleError(
                f"event {str(edge.event)!r} leads to {edge.dest.name}, not a final state: a "
                f"reason or detail goes only with an event that ends a request"
            )
        if reason is not None and not self.failure:
            events = ", ".join(str(e) for e in table.failure_events)
            states = ", ".join(s.name for s in sorted(table.failure_states()))
            where = (
                f"a state that a failure event of table {table.name!r} ({events}) leads to "
                f"({states})" if events else f"a failure state; table {table.name!r} declares "
                f"no failure events"
            )
            raise LifecycleError(
                f"event {str(edge.event)!r} leads to {edge.dest.name}, not a failure state: a "
                f"failure reason goes only with an event into {where}"
            )
        reasons = table.reasons
        if reason is not None and reasons is not None and not isinstance(reason, reasons):
            raise LifecycleError(f"{table.name}: reason {reason!r} is not a {reasons.__name__}")
        return Firing(edge.event, edge.source, edge.dest, reason, detail)

    def bind(self, record: type, takes_event: Mapping[str, bool]) -> None:
        """Make the guard calls of ``record``, whose guards were checked (``takes_event``: per
        guard, whether it takes the event)."""
        self.guard_calls[record] = tuple(
            (name, getattr(record, name), takes_event[name], wanted) for name, wanted in self.guards
        )


def refusal_text(guard: str, wanted: bool) -> str:
    """How a refusal names a guard that did not give the ``wanted`` answer."""
    return f"{guard} is {'false' if wanted else 'true'}"


def count_ended(
    finished: collections.Counter[tuple[enum.IntEnum, enum.Enum | None]],
    reqs: Sequence[Any],
    dst: enum.IntEnum,
    firing: Firing,
) -> None:
    """How a batch that entered the final ``dst`` ended: its reason and detail set from
    ``firing``, and counted in ``finished`` by (final state, reason)."""
    reason, detail = firing.reason, firing.detail
    if detail:
        for r in reqs:
            r.detail = detail
    if reason is not None:
        for r in reqs:
            r.reason = reason
        finished[(dst, reason)] += len(reqs)
    elif len(reqs) == 1:  # the one-request path
        finished[(dst, reqs[0].reason)] += 1
    else:  # each ends with the reason it holds, most often None: those are counted in C
        held = [r.reason for r in reqs]
        unset = held.count(None)
        if unset:
            finished[(dst, None)] += unset
        if unset != len(held):
            for kept, n in collections.Counter(x for x in held if x is not None).items():
                finished[(dst, kept)] += n


def run_hooks(
    reqs: Sequence[Any], hooks: tuple[tuple[str, Hook, bool], ...], firing: Firing
) -> list[tuple[str, str, BaseException]]:
    """Call every hook for every request, each request's in table order; return the ones that
    raised (request id, hook name, exception)."""
    errors: list[tuple[str, str, BaseException]] = []
    if len(hooks) == 2 and not (hooks[0][2] or hooks[1][2]):
        # Two hooks that take no event (a request table's final states: release, respond) are
        # called without a loop over them: that loop's iterator, made again per request, cost
        # about as much as the two calls.
        (first, hook1, _), (second, hook2, _) = hooks
        for r in reqs:
            try:
                hook1(r)
            except Exception as exc:  # reported together once every hook has run
                errors.append((r.rid, first, exc))
            try:
                hook2(r)
            except Exception as exc:
                errors.append((r.rid, second, exc))
        return errors
    for r in reqs:
        for name, hook, takes_event in hooks:
            try:
                if takes_event:
                    hook(r, firing)
                else:
                    hook(r)
            except Exception as exc:  # reported together once every hook has run
                errors.append((r.rid, name, exc))
    return errors
