"""Lifecycle tables: the one place a request lifecycle is defined.

Rules of this module
--------------------
1. A lifecycle is *data*: an ordered set of states (an ``IntEnum``), an initial state, the final
   states, and a tuple of :class:`Edge` records. The machine, the validator, the diagram
   generators and the test-path generator all read the same :class:`LifecycleTable`; nothing else
   defines a transition.
2. Callbacks and guards are declared here *by name*. A guard names a boolean method of the
   request record; a hook names a callable the owner of a :class:`~lifecycle.machine.Lifecycle`
   supplies (the lifecycle knows "release", not torch).
3. A table is validated when it is built (:func:`make_table`), so a broken table cannot be
   imported: exactly one initial state; nothing leaves a final state; every state reachable;
   every non-final state can reach a final state; the failure events are legal from every
   non-final state.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping

import attrs

from lifecycle.errors import InvalidTable


@attrs.frozen
class Edge:
    """``event`` moves a request from ``source`` to ``dest`` when every guard in ``conditions``
    is true and every guard in ``unless`` is false; then the hooks in ``after`` run."""

    event: str
    source: enum.IntEnum
    dest: enum.IntEnum
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    doc: str = ""


@attrs.frozen
class LifecycleTable:
    """A validated lifecycle; build it with :func:`make_table`."""

    name: str
    states: type[enum.IntEnum]
    initial: enum.IntEnum
    finals: frozenset[enum.IntEnum]
    edges: tuple[Edge, ...]
    failure_events: tuple[str, ...]
    on_enter: Mapping[enum.IntEnum, tuple[str, ...]]
    # Derived lookups, built once by make_table.
    lookup: Mapping[tuple[enum.IntEnum, str], Edge] = attrs.field(repr=False)
    events: tuple[str, ...] = attrs.field(repr=False)

    def edge(self, state: enum.IntEnum, event: str) -> Edge | None:
        return self.lookup.get((state, event))

    def is_final(self, state: enum.IntEnum) -> bool:
        return state in self.finals

    def live_states(self) -> tuple[enum.IntEnum, ...]:
        return tuple(s for s in self.states if s not in self.finals)

    def hooks(self) -> frozenset[str]:
        """Every hook name the table refers to."""
        names = {h for e in self.edges for h in e.after}
        names.update(h for hs in self.on_enter.values() for h in hs)
        return frozenset(names)

    def guards(self) -> frozenset[str]:
        return frozenset(g for e in self.edges for g in (*e.conditions, *e.unless))


def make_table(
    name: str,
    states: type[enum.IntEnum],
    *,
    initial: enum.IntEnum,
    finals: Iterable[enum.IntEnum],
    edges: Iterable[Edge],
    failure_events: Iterable[str] = (),
    on_enter: Mapping[enum.IntEnum, tuple[str, ...]] | None = None,
) -> LifecycleTable:
    """Build and validate a table; raise :class:`InvalidTable` naming what is wrong."""
    edges = tuple(edges)
    finals = frozenset(finals)
    lookup: dict[tuple[enum.IntEnum, str], Edge] = {}
    for e in edges:
        for s in (e.source, e.dest):
            if not isinstance(s, states):
                raise InvalidTable(f"{name}: edge {e.event!r} names {s!r}, not a {states.__name__}")
        key = (e.source, e.event)
        if key in lookup:
            # One event from one state has one outcome: a second edge would make the table
            # ambiguous, and the guards are checks, not a dispatch mechanism.
            raise InvalidTable(
                f"{name}: two edges for event {e.event!r} from state {e.source.name}"
            )
        lookup[key] = e
    events = tuple(dict.fromkeys(e.event for e in edges))
    table = LifecycleTable(
        name=name,
        states=states,
        initial=initial,
        finals=finals,
        edges=edges,
        failure_events=tuple(failure_events),
        on_enter=dict(on_enter or {}),
        lookup=lookup,
        events=events,
    )
    validate(table)
    return table


def validate(table: LifecycleTable) -> None:
    """Check the definition rules; raise :class:`InvalidTable` on the first broken one."""
    name = table.name
    states = list(table.states)
    if not isinstance(table.initial, table.states):
        raise InvalidTable(f"{name}: the initial state {table.initial!r} is not a state")
    if not table.finals:
        raise InvalidTable(f"{name}: no final state")
    if table.initial in table.finals:
        raise InvalidTable(f"{name}: the initial state {table.initial.name} is final")
    for e in table.edges:
        if e.source in table.finals:
            raise InvalidTable(
                f"{name}: edge {e.event!r} leaves final state {e.source.name} "
                f"(final states are absorbing)"
            )
    for s in table.on_enter:
        if not isinstance(s, table.states):
            raise InvalidTable(f"{name}: on_enter names {s!r}, not a state")
    if table.on_enter.get(table.initial):
        # Admission is not an edge: nothing would run them.
        raise InvalidTable(f"{name}: on_enter hooks on the initial state {table.initial.name}")

    forward: dict[enum.IntEnum, set[enum.IntEnum]] = {s: set() for s in states}
    backward: dict[enum.IntEnum, set[enum.IntEnum]] = {s: set() for s in states}
    for e in table.edges:
        forward[e.source].add(e.dest)
        backward[e.dest].add(e.source)

    reachable = _closure({table.initial}, forward)
    for s in states:
        if s not in reachable:
            raise InvalidTable(f"{name}: state {s.name} is unreachable from {table.initial.name}")

    can_finish = _closure(set(table.finals), backward)
    for s in states:
        if s not in can_finish:
            raise InvalidTable(f"{name}: state {s.name} cannot reach a final state (a trap)")

    for event in table.failure_events:
        for s in table.live_states():
            edge = table.lookup.get((s, event))
            if edge is None:
                raise InvalidTable(
                    f"{name}: failure event {event!r} is not legal from state {s.name}"
                )
            if edge.dest not in table.finals:
                raise InvalidTable(
                    f"{name}: failure event {event!r} from {s.name} leads to non-final "
                    f"{edge.dest.name}"
                )
            if edge.conditions or edge.unless:
                raise InvalidTable(
                    f"{name}: failure event {event!r} from {s.name} is guarded; a failure "
                    f"must always be possible"
                )


def _closure(
    start: set[enum.IntEnum], graph: Mapping[enum.IntEnum, set[enum.IntEnum]]
) -> set[enum.IntEnum]:
    seen = set(start)
    todo = deque(start)
    while todo:
        for nxt in graph[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
