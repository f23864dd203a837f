"""The shared ``transitions`` machine of a table, and each edge as a lifecycle fires it.

A table has one ``transitions.Machine`` (:func:`shared_machine`), shared by every
:class:`~lifecycle.machine.Lifecycle` on it: no model is added to it, and it has no callbacks,
conditions or automatic transitions; it holds the states and transitions, and the trigger path
executes the edge's ``transitions.Transition`` on it to set a request's state. A
:class:`Step` is one edge as one lifecycle fires it, with everything firing needs looked up
once, when the lifecycle is built.

The machine is the table's, and **sealed**: it takes no callbacks, conditions, transitions,
states or models once built. Adding one the library's way (``add_callback``,
``machine.on_enter_PAID(f)``, ``machine.before_pay(f)``, appending to or assigning a callback
list, ``add_transition``, ``add_model``, ...) raises :class:`~lifecycle.errors.LifecycleError`
at once. A lifecycle runs the table's hooks and nothing else, on both firing paths (the batch
path never executes the library's transition, so a callback would have run on one path only,
and one that raised would have left the state set but the index and timeline not): what should
run when a request moves is a hook named in the table.

The machine's classes are the library's with three changes that keep its behaviour and drop
work it would do for nothing (the library's ``Transition.execute`` was most of the one-request
path's cost): a state reads its enum member's name once; a state is found by member or name in
one dict lookup; and a transition, having no callback or condition of the library's to run,
sets the model's state through the machine's ``set_state`` without the library's eight logging
calls and empty callback loops while the library's logger is quiet. Switch on ``transitions``'
logging and each transition runs the library's full ``execute``, which logs it.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, NoReturn, TypeVar

from transitions import Machine
from transitions.core import Event, EventData, State, Transition

from lifecycle.binding import Firing
from lifecycle.errors import HookFailed, LifecycleError
from lifecycle.record import Tracked
from lifecycle.table import Edge, LifecycleTable
from lifecycle.weak import PerObject

R = TypeVar("R", bound=Tracked)
#: A hook: ``hook(req)`` or ``hook(req, event)`` (``event`` is a :class:`Firing`).
Hook = Callable[..., None]

# Each table's machine, kept while the table lives and dropped with it (lifecycle.weak): a
# table built at run time (a test's, a fuzzed example's, a tenant's) takes its machine with it.
# The machine holds the table's states and events, never the table itself.
_MACHINES: PerObject[LifecycleTable, Machine] = PerObject()


def shared_machine(table: LifecycleTable) -> Machine:
    """The one ``transitions.Machine`` of ``table`` (built on first use, kept while the table
    lives)."""
    machine = _MACHINES.get(table)
    if machine is not None:
        return machine
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
    machine.seal(table.name)
    return _MACHINES.put(table, machine)


def _no_callbacks(table: str, where: str) -> LifecycleError:
    return LifecycleError(
        f"{table}: the table's shared transitions machine takes no callbacks, transitions, "
        f"states or models ({where}): a lifecycle runs the table's hooks and nothing else, the "
        f"same on both firing paths; name a hook in the table (Edge(..., after=NAME) or "
        f"on_enter={{STATE: NAME}}) and give it to Lifecycle(hooks={{NAME: ...}})")


class _NoCallbacks(tuple[Any, ...]):
    """A callback list of a sealed machine: empty, and it stays so. The library adds a callback
    by appending to its list; this refuses, naming the table and where."""

    table: str
    where: str

    def __new__(cls, table: str, where: str) -> _NoCallbacks:
        made = super().__new__(cls)
        made.table, made.where = table, where
        return made

    def append(self, func: object) -> NoReturn:
        raise _no_callbacks(self.table, self.where)

    def extend(self, funcs: object) -> NoReturn:
        raise _no_callbacks(self.table, self.where)

    def insert(self, index: int, func: object) -> NoReturn:
        raise _no_callbacks(self.table, self.where)

    def __add__(self, funcs: object) -> NoReturn:  # ``+=`` too
        raise _no_callbacks(self.table, self.where)


class _Sealed:
    """Refuses assigning its ``_callbacks`` attributes once :meth:`seal` has run."""

    _callbacks: tuple[str, ...] = ()
    #: The table whose machine this belongs to, once sealed.
    _sealed_by = ""

    def __setattr__(self, name: str, value: Any) -> None:
        if self._sealed_by and name in self._callbacks:
            raise _no_callbacks(self._sealed_by, f"{name} of {self._what()}")
        super().__setattr__(name, value)

    def _what(self) -> str:
        raise NotImplementedError

    def seal(self, table: str) -> None:
        for name in self._callbacks:
            super().__setattr__(self._stored(name), _NoCallbacks(table, f"{name} of "
                                                                  f"{self._what()}"))
        super().__setattr__("_sealed_by", table)

    def _stored(self, name: str) -> str:
        """The attribute a callback list ``name`` is kept in."""
        return name


class _NamedState(_Sealed, State):
    """A transitions State that reads its enum member's name once: ``State.name`` recomputes
    it on every access, and the library reads it several times per transition (its logging
    arguments are built whether or not anything is logged)."""

    _callbacks = ("on_enter", "on_exit")

    def __init__(self, name: str | enum.Enum, *args: Any, **kwargs: Any) -> None:
        super().__init__(name, *args, **kwargs)
        self._plain_name: str = name.name if isinstance(name, enum.Enum) else name

    @property
    def name(self) -> str:
        return self._plain_name

    def _what(self) -> str:
        return f"state {self._plain_name}"


#: The library's own logger: while it logs its transitions, they run the library's execute.
_LIBRARY_LOG = logging.getLogger("transitions.core")


class _TableTransition(_Sealed, Transition):
    """A transitions Transition whose execute skips what would do nothing: the machine is
    sealed, so no callback or condition of the library's can run, and while the library's
    logger is quiet it sets the state as the library would (``Machine.set_state``, then the
    event data's state) and reports success; otherwise it is the library's ``execute``."""

    _callbacks = ("prepare", "conditions", "before", "after")

    #: The destination's State, found once when the machine is sealed.
    dest_state: State

    def execute(self, event_data: EventData) -> bool:
        if _LIBRARY_LOG.isEnabledFor(logging.INFO):
            return bool(super().execute(event_data))
        dest = self.dest_state
        event_data.machine.set_state(dest, event_data.model)
        event_data.state = dest
        return True

    def _what(self) -> str:
        return f"the transition {self.source} -> {self.dest}"


class _TableMachine(_Sealed, Machine):
    """The shared machine: transitions' Machine with the state and transition classes above,
    a state lookup that finds an enum member or a name in one dict lookup (the library turns a
    member into its name first, which costs more than the lookup), and, once sealed
    (:func:`shared_machine`), no callbacks, transitions, states or models added."""

    state_cls = _NamedState
    transition_cls = _TableTransition
    _callbacks = ("before_state_change", "after_state_change", "prepare_event",
                  "finalize_event", "on_exception", "on_final")
    _by_key: Mapping[str | enum.Enum, State] = {}

    def _what(self) -> str:
        return "the machine"

    def _stored(self, name: str) -> str:
        return f"_{name}"  # the library's properties read these

    def seal(self, table: str) -> None:
        for state in self.states.values():
            assert isinstance(state, _NamedState)
            state.seal(table)
        for event in self.events.values():
            for transitions in event.transitions.values():
                for transition in transitions:
                    # (A table's edges all have a destination: no internal transitions.)
                    assert isinstance(transition, _TableTransition) and transition.dest
                    transition.dest_state = self.get_state(transition.dest)
                    transition.seal(table)
        super().seal(table)

    def _refuse_when_sealed(self, what: str) -> None:
        if self._sealed_by:
            raise _no_callbacks(self._sealed_by, what)

    def add_states(self, states: Any, *args: Any, **kwargs: Any) -> None:
        self._refuse_when_sealed("add_states")
        super().add_states(states, *args, **kwargs)
        by_key: dict[str | enum.Enum, State] = {}
        for name, state in self.states.items():
            by_key[name] = by_key[state.value] = state
        self._by_key = by_key

    def add_transition(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_when_sealed("add_transition")
        super().add_transition(*args, **kwargs)

    def remove_transition(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_when_sealed("remove_transition")
        super().remove_transition(*args, **kwargs)

    def add_model(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_when_sealed("add_model: admit records to a Lifecycle")
        super().add_model(*args, **kwargs)

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
        failure state (one a failure event leads to); a detail is a string, as the trigger
        methods take it (``TypeError`` otherwise)."""
        edge = self.edge
        if not isinstance(detail, str):
            raise TypeError(
                f"event {str(edge.event)!r}: detail is a string, got {type(detail).__name__} "
                f"{detail!r}; pass the reason by keyword (reason=...)")
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
    raised (request id, hook name, exception). A hook that raises does not stop the others, not
    even with a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``,
    ``asyncio.CancelledError``): every request moved, so every one's hooks must run
    (:func:`hooks_raised` re-raises it once they have)."""
    errors: list[tuple[str, str, BaseException]] = []
    if len(hooks) == 2 and not (hooks[0][2] or hooks[1][2]):
        # Two hooks that take no event (a request table's final states: release, respond) are
        # called without a loop over them: that loop's iterator, made again per request, cost
        # about as much as the two calls.
        (first, hook1, _), (second, hook2, _) = hooks
        for r in reqs:
            try:
                hook1(r)
            except BaseException as exc:  # reported together once every hook has run
                errors.append((r.rid, first, exc))
            try:
                hook2(r)
            except BaseException as exc:
                errors.append((r.rid, second, exc))
        return errors
    for r in reqs:
        for name, hook, takes_event in hooks:
            try:
                if takes_event:
                    hook(r, firing)
                else:
                    hook(r)
            except BaseException as exc:  # reported together once every hook has run
                errors.append((r.rid, name, exc))
    return errors


def hooks_raised(
    event: str, dest: enum.IntEnum, errors: Sequence[tuple[str, str, BaseException]]
) -> BaseException:
    """What a call raises once every hook ran, when some raised (``errors``, in the order they
    ran): the first exception that is not an ``Exception`` (``KeyboardInterrupt``,
    ``SystemExit``, ``asyncio.CancelledError``), itself, so that it keeps its meaning for the
    caller, with a note saying the event took effect and naming every hook that raised;
    otherwise :class:`~lifecycle.errors.HookFailed` listing them, the first as its cause."""
    for _, _, exc in errors:
        if not isinstance(exc, Exception):
            raised = "; ".join(f"{hook!r} for {rid!r}: {type(e).__name__}"
                               for rid, hook, e in errors)
            exc.add_note(
                f"lifecycle: raised by a hook; event {str(event)!r} took effect: every request "
                f"it was fired for is in {dest.name}, and every hook ran (hooks that raised: "
                f"{raised})")
            return exc
    failed = HookFailed(event, dest, errors)
    failed.__cause__ = errors[0][2]
    return failed
