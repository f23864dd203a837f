"""Lifecycle tables: the one place a request lifecycle is defined.

Rules of this module
--------------------
1. A lifecycle is *data*: an ordered set of states (an ``IntEnum``), an initial state, the final
   states, and a tuple of :class:`Edge` records; optionally the table's events (a ``StrEnum``,
   so a misspelt event is an error where it is written), its failure reasons (any ``Enum``) and
   its record class. The machine, the validator, the diagram generators, the test-path
   generator and the fuzzer all read the same :class:`LifecycleTable`; nothing else defines a
   transition.
2. Callbacks and guards are declared here *by name*. A guard names a method of the request
   record (``def g(self)`` or ``def g(self, event)``); a hook names a callable the owner of a
   :class:`~lifecycle.machine.Lifecycle` supplies (the lifecycle knows "release", not torch).
   ``once`` names the hooks that must run exactly once over a request's life (its resources):
   by default the hooks that entering every final state runs; the validator refuses one that
   some way from the initial state to a final state never runs, and the fuzzer counts them.
3. A table is validated when it is built (:func:`make_table`), so a broken table cannot be
   imported: a name that can name a file and a docs marker; exactly one initial state;
   nothing leaves a final state; every state reachable; every non-final state can reach a
   final state; the failure events are legal from every non-final state; the events are those
   of the events enum, each named by a Python identifier that no record attribute (``state``,
   ``fire``, ...) and no timeline admission (``admitted``) uses; every ``once`` hook runs on
   every way to a final state; the guards are methods of the record class. Every broken rule
   is named at once, except one the others are checked from (the name, the initial and final
   states, the edges' states and events): that one is named alone. Building a table
   with ``record=`` also gives that class its trigger methods (:mod:`lifecycle.binding`), and
   makes it the table's: a lifecycle of a table built without ``record=`` refuses to admit a
   record of that class unless it was given ``record=`` itself (:func:`tables_for`).
"""

from __future__ import annotations

import enum
import re
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping

import attrs

from lifecycle.binding import check_event_name, check_guards, install_triggers, suggest
from lifecycle.errors import InvalidTable
from lifecycle.weak import PerObject


def _names(value: str | Iterable[str]) -> tuple[str, ...]:
    # A lone name is one name, not its letters.
    return (value,) if isinstance(value, str) else tuple(value)


def _edge_names(value: str | Iterable[str]) -> tuple[str, ...]:
    """An edge's guards or hooks: names, refused with the rule when given as callables (as
    ``transitions`` takes them)."""
    names = (value,) if callable(value) else _names(value)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(
                f"an Edge names its guards and hooks, got {n!r}: a guard is the name of a "
                "method of the record class, a hook the name of a callable given to "
                "Lifecycle(hooks={name: callable})")
    return names


@attrs.frozen
class Edge:
    """``event`` moves a request from ``source`` to ``dest`` when every guard in ``conditions``
    is true and every guard in ``unless`` is false; then the hooks in ``after`` run."""

    event: str
    source: enum.IntEnum
    dest: enum.IntEnum
    conditions: tuple[str, ...] = attrs.field(default=(), converter=_edge_names)
    unless: tuple[str, ...] = attrs.field(default=(), converter=_edge_names)
    after: tuple[str, ...] = attrs.field(default=(), converter=_edge_names)
    doc: str = ""

    @property
    def guarded(self) -> bool:
        return bool(self.conditions or self.unless)


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
    #: The table's events enum, when it declares one (its members are the event names).
    event_type: type[enum.StrEnum] | None = attrs.field(default=None, kw_only=True)
    #: The table's failure reasons, when it declares them.
    reasons: type[enum.Enum] | None = attrs.field(default=None, kw_only=True)
    #: Hooks that must run exactly once over a request's life.
    once: frozenset[str] = attrs.field(default=frozenset(), kw_only=True)
    #: The record class the table was bound to, if any.
    record: type | None = attrs.field(default=None, kw_only=True, repr=False)

    def edge(self, state: enum.IntEnum, event: str) -> Edge | None:
        return self.lookup.get((state, event))

    def no_edge(self, state: enum.IntEnum, event: str) -> str:
        """Why ``event`` cannot fire from ``state``: no such event, or no edge from there."""
        if event not in self.events:
            known = ", ".join(str(e) for e in self.events)
            close = suggest(str(event), map(str, self.events))
            return f"table {self.name!r} has no such event{close}; its events: {known}"
        return f"{state.name} has no {str(event)!r} edge"

    def failure_states(self) -> frozenset[enum.IntEnum]:
        """The states a failure event leads to: the only states a failure reason goes with."""
        return frozenset(e.dest for e in self.edges if e.event in self.failure_events)

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

    def hooks_of(self, edge: Edge) -> tuple[str, ...]:
        """The hooks taking ``edge`` runs, in order: its ``after`` hooks, then the destination's
        ``on_enter`` hooks."""
        return (*edge.after, *self.on_enter.get(edge.dest, ()))


# A table's name names its files (``pdlife diagram --out DIR`` writes NAME.FORMAT) and its
# docs markers (``<!-- BEGIN GENERATED: NAME-mermaid -->``), and starts every message.
_TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_table_name(name: object) -> None:
    """Refuse a table name that cannot name a file and a docs marker."""
    if isinstance(name, str) and _TABLE_NAME.fullmatch(name):
        return
    raise InvalidTable(
        f"table name {name!r} is not usable: a table's name names its diagram files "
        f"(NAME.dot) and its docs markers (<!-- BEGIN GENERATED: NAME-mermaid -->), so it is "
        f"ASCII letters, digits, '_', '-' and '.', starting with a letter, a digit or '_'")


def _normalise_events(
    name: str, events: type[enum.StrEnum] | None, edges: tuple[Edge, ...]
) -> tuple[Edge, ...]:
    """Edges whose events are members of ``events`` (a plain name is looked up by value)."""
    if events is None:
        return edges
    if not (isinstance(events, type) and issubclass(events, enum.StrEnum)):
        raise InvalidTable(
            f"{name}: events must be an enum.StrEnum class, got {events!r}; to use plain "
            f"names, leave events out (the edges' names are the events)")
    out = []
    for e in edges:
        try:
            member = events(e.event)
        except ValueError:
            raise InvalidTable(
                f"{name}: edge event {str(e.event)!r} is not a member of {events.__name__}"
            ) from None
        out.append(e if e.event is member else attrs.evolve(e, event=member))
    return tuple(out)


def _unused_events(name: str, events: type[enum.StrEnum] | None,
                   edges: tuple[Edge, ...]) -> Iterator[str]:
    if events is None:
        return
    unused = [m.value for m in events if all(e.event is not m for e in edges)]
    if unused:
        yield f"{name}: {events.__name__} has events no edge takes: {unused}"


def _check_edge_states(name: str, states: type[enum.IntEnum], edges: tuple[Edge, ...]) -> None:
    for e in edges:
        for s in (e.source, e.dest):
            if not isinstance(s, states):
                raise InvalidTable(f"{name}: edge {str(e.event)!r} names {s!r}, not a "
                                   f"{states.__name__}{_state_hint(s, states)}")


def _lookup(
    name: str, states: type[enum.IntEnum], edges: tuple[Edge, ...]
) -> dict[tuple[enum.IntEnum, str], Edge]:
    _check_edge_states(name, states, edges)
    lookup: dict[tuple[enum.IntEnum, str], Edge] = {}
    for e in edges:
        both = sorted(set(e.conditions) & set(e.unless))
        if both:
            raise InvalidTable(
                f"{name}: edge {str(e.event)!r} from {e.source.name} has guard {both[0]!r} in "
                "both conditions and unless: it can never fire")
        key = (e.source, e.event)
        if key in lookup:
            # One event from one state has one outcome: a second edge would make the table
            # ambiguous, and the guards are checks, not a dispatch mechanism.
            raise InvalidTable(
                f"{name}: two edges for event {str(e.event)!r} from state {e.source.name}"
            )
        lookup[key] = e
    return lookup


# Per record class, the tables built with it as their ``record=``, weakly (a table built at run
# time goes when it goes; a table refers to its class, so a strong reference here would keep
# the class alive through this cache).
_BUILT_FOR: PerObject[type, list[weakref.ref[LifecycleTable]]] = PerObject()


def tables_for(record: type) -> list[LifecycleTable]:
    """The live tables built with ``record=`` this class or a class it derives from: the
    class's own first, each class's in the order they were built."""
    out: list[LifecycleTable] = []
    for klass in record.__mro__:
        for ref in _BUILT_FOR.get(klass) or ():
            table = ref()
            if table is not None and all(t is not table for t in out):
                out.append(table)
    return out


def make_table(
    name: str,
    states: type[enum.IntEnum],
    *,
    initial: enum.IntEnum,
    finals: Iterable[enum.IntEnum],
    edges: Iterable[Edge],
    events: type[enum.StrEnum] | None = None,
    failure_events: Iterable[str] = (),
    on_enter: Mapping[enum.IntEnum, Iterable[str]] | None = None,
    reasons: type[enum.Enum] | None = None,
    once: Iterable[str] | None = None,
    record: type | None = None,
) -> LifecycleTable:
    """Build and validate a table; raise :class:`InvalidTable` naming what is wrong.

    ``events`` is the table's ``StrEnum`` of events (every member must be taken by an edge);
    ``reasons`` the ``Enum`` of its failure reasons; ``once`` the hooks that must run exactly
    once per request (default: :func:`entering_every_final`, the hooks that entering every
    final state runs); ``record`` the request class, whose guards are checked here and which
    gets one trigger method per event (a lifecycle of a table built without ``record=``
    admits records of that class only when it is given ``record=``).
    """
    check_table_name(name)
    edges = _normalise_events(name, events, tuple(edges))
    finals = frozenset(finals)
    lookup = _lookup(name, states, edges)
    all_events = tuple(dict.fromkeys(e.event for e in edges))
    by_name = {str(e): e for e in all_events}
    entered = {s: _names(hs) for s, hs in (on_enter or {}).items()}
    if once is None:
        once = entering_every_final(edges, finals, entered)
    table = LifecycleTable(
        name=name,
        states=states,
        initial=initial,
        finals=finals,
        edges=edges,
        failure_events=tuple(by_name.get(str(f), f) for f in _names(failure_events)),
        on_enter=entered,
        lookup=lookup,
        events=all_events,
        event_type=events,
        reasons=reasons,
        once=frozenset(_names(once)),
        record=record,
    )
    validate(table, also=_unused_events(name, events, edges))
    if record is not None:
        bind_record(table, record)
        refs = _BUILT_FOR.get(record)
        if refs is None:
            refs = _BUILT_FOR.put(record, [])
        refs[:] = [*(r for r in refs if r() is not None), weakref.ref(table)]
    return table


def entering_every_final(
    edges: Iterable[Edge],
    finals: Iterable[enum.IntEnum],
    on_enter: Mapping[enum.IntEnum, Iterable[str]],
) -> frozenset[str]:
    """The hooks that entering every final state runs, whichever edge enters it: the state's
    ``on_enter`` hooks and the ``after`` hooks of every edge into it, for each final state
    alike. A hook only some final states run (a ``log_failure`` on FAILED alone) is not one."""
    edges = tuple(edges)
    common: frozenset[str] | None = None
    for final in finals:
        afters = [frozenset(e.after) for e in edges if e.dest is final]
        runs = frozenset(on_enter.get(final, ())).union(
            frozenset.intersection(*afters) if afters else ())
        common = runs if common is None else common & runs
    return common or frozenset()


def bind_record(table: LifecycleTable, record: type) -> dict[str, bool]:
    """Check ``table``'s guards against ``record`` and give it one trigger method per event;
    per guard, whether it takes the event."""
    forms = guard_methods(table, record)
    docs = {str(e.event): e.doc for e in reversed(table.edges)}
    install_triggers(table.name, {str(ev): docs[str(ev)] for ev in table.events}, record)
    return forms


def guard_methods(table: LifecycleTable, record: type) -> dict[str, bool]:
    """Check ``table``'s guards against ``record``; per guard, whether it takes the event."""
    named_by: dict[str, str] = {}
    for e in table.edges:
        for g in (*e.conditions, *e.unless):
            named_by.setdefault(g, str(e.event))
    return check_guards(table.name, named_by, record)


def validate(table: LifecycleTable, also: Iterable[str] = ()) -> None:
    """Check the definition rules; raise :class:`InvalidTable` naming every broken one (one
    line each, with ``also``'s), or, where a rule the others are checked from is broken
    (:func:`_check_foundations`), that one alone."""
    _check_foundations(table)
    name = table.name
    problems = [*also, *_state_problems(table), *_graph_problems(table),
                *_failure_event_problems(table)]
    if table.reasons is not None and not (
        isinstance(table.reasons, type) and issubclass(table.reasons, enum.Enum)
    ):
        problems.append(f"{name}: reasons must be an Enum class, got {table.reasons!r}")
    unknown = sorted(table.once - table.hooks())
    if unknown:
        problems.append(f"{name}: once names hooks the table does not run: {unknown}")
    problems += _once_problems(table, skip=set(unknown))
    if table.record is not None:
        try:
            guard_methods(table, table.record)
        except InvalidTable as exc:
            problems.append(str(exc))
    if problems:
        raise InvalidTable("\n".join(problems))


def _check_foundations(table: LifecycleTable) -> None:
    """Raise :class:`InvalidTable` for the first broken rule of those every other rule is
    checked from, alone: the other checks would only restate it, misleadingly (with no final
    state, each failure event "leads to non-final" states; from a final initial state, every
    other state is "unreachable"). They are the table's name; its initial state (a state, not
    final) and final states (states, at least one); its edges' states (states of the table)
    and events (members of the events enum, each able to name a trigger method). make_table
    checks the edges' as it builds the table; a table built by hand is checked here."""
    name = table.name
    check_table_name(name)
    states = table.states
    if not isinstance(table.initial, states):
        raise InvalidTable(f"{name}: the initial state {table.initial!r} is not a state"
                           f"{_state_hint(table.initial, states)}")
    for s in table.finals:
        if not isinstance(s, states):
            raise InvalidTable(f"{name}: finals names {s!r}, not a {states.__name__}"
                               f"{_state_hint(s, states)}")
    if not table.finals:
        raise InvalidTable(f"{name}: no final state (finals= names the states a request "
                           f"ends in)")
    if table.initial in table.finals:
        raise InvalidTable(f"{name}: the initial state {table.initial.name} is final (a "
                           f"request would end as it is admitted)")
    _check_edge_states(name, states, table.edges)
    _normalise_events(name, table.event_type, table.edges)
    for event in dict.fromkeys((*table.events, *(e.event for e in table.edges))):
        check_event_name(name, event)


def _state_problems(table: LifecycleTable) -> Iterator[str]:
    name = table.name
    for e in table.edges:
        if e.source in table.finals:
            yield (f"{name}: edge {str(e.event)!r} leaves final state {e.source.name} "
                   f"(final states are absorbing)")
    for s in table.on_enter:
        if not isinstance(s, table.states):
            yield (f"{name}: on_enter names {s!r}, not a state"
                   f"{_state_hint(s, table.states)}")
    if table.on_enter.get(table.initial):
        # Admission is not an edge: they would run on the edges back into it only.
        back = sorted({str(e.event) for e in table.edges if e.dest is table.initial})
        instead = (f"; for the edges back into it, put them in after= on "
                   f"{', '.join(repr(b) for b in back)}" if back else "")
        yield (f"{name}: on_enter hooks on the initial state {table.initial.name}: admission "
               f"runs no hooks, so they would not run for a request's start{instead}")


def _graph_problems(table: LifecycleTable) -> Iterator[str]:
    name = table.name
    states = list(table.states)
    forward: dict[enum.IntEnum, set[enum.IntEnum]] = {s: set() for s in states}
    backward: dict[enum.IntEnum, set[enum.IntEnum]] = {s: set() for s in states}
    for e in table.edges:
        forward[e.source].add(e.dest)
        backward[e.dest].add(e.source)

    reachable = _closure({table.initial}, forward)
    for s in states:
        if s not in reachable:
            yield f"{name}: state {s.name} is unreachable from {table.initial.name}"

    can_finish = _closure(set(table.finals), backward)
    for s in states:
        if s not in can_finish:
            yield f"{name}: state {s.name} cannot reach a final state (a trap)"


def _once_problems(table: LifecycleTable, skip: set[str]) -> Iterator[str]:
    """A ``once`` hook must run on every request's way to a final state: refuse one that some
    way from the initial state to a final state, by the table's edges, never runs (an edge runs
    its ``after`` hooks and its destination's ``on_enter`` hooks). Guards are not read: the
    way may be one they never let a request take, which only the fuzzer can tell."""
    for hook in sorted(table.once - skip):
        # Breadth first from the initial state over the edges that do not run ``hook``.
        came_by: dict[enum.IntEnum, Edge | None] = {table.initial: None}
        todo = deque([table.initial])
        while todo:
            state = todo.popleft()
            if state in table.finals:
                path = []
                edge = came_by[state]
                while edge is not None:
                    path.append(str(edge.event))
                    edge = came_by[edge.source]
                yield (f"{table.name}: once hook {hook!r} does not run on every way to a final "
                       f"state: a request that takes {', '.join(reversed(path))} ends in "
                       f"{state.name} without it (a once hook runs exactly once per request: "
                       f"run it on that way too, or leave it out of once)")
                break
            for e in table.edges:
                if (e.source is state and e.dest not in came_by and hook not in e.after
                        and hook not in table.on_enter.get(e.dest, ())):
                    came_by[e.dest] = e
                    todo.append(e.dest)


def _failure_event_problems(table: LifecycleTable) -> Iterator[str]:
    name = table.name
    for event in table.failure_events:
        if event not in table.events:
            yield (f"{name}: failure event {str(event)!r} is not an event of the "
                   f"table{suggest(str(event), map(str, table.events))}")
            continue
        missing = [s.name for s in table.live_states() if (s, event) not in table.lookup]
        if missing:
            yield (f"{name}: failure event {str(event)!r} is not legal from "
                   f"{'state' if len(missing) == 1 else 'states'} {', '.join(missing)}")
        for s in table.live_states():
            edge = table.lookup.get((s, event))
            if edge is None:
                continue
            if edge.dest not in table.finals:
                yield (f"{name}: failure event {str(event)!r} from {s.name} leads to "
                       f"non-final {edge.dest.name}")
            elif edge.guarded:
                yield (f"{name}: failure event {str(event)!r} from {s.name} is guarded; a "
                       f"failure must always be possible")


def _state_hint(value: object, states: type[enum.IntEnum]) -> str:
    """What to write instead of ``value``, a state given by its name or misspelt."""
    if isinstance(value, str):
        if value in states.__members__:
            return f" (give the member {states.__name__}.{value}, not its name)"
        return suggest(value, states.__members__)
    return ""


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
