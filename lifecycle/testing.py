"""Property-based testing of lifecycles: Hypothesis strategies and a stateful test machine.

Public API for embedders: point these at a table (the shipped ones, or your own), a way to make
a fresh record, and the hooks your service supplies, and Hypothesis will fire random legal and
illegal events at a real :class:`~lifecycle.machine.Lifecycle`, singly and in batches,
checking the framework's rules and your code's (pure guards, once-only resource hooks, your own
invariants) after every step::

    from lifecycle.testing import lifecycle_state_machine

    TestOrders = lifecycle_state_machine(
        ORDER_TABLE,
        lambda rid: Order(rid, total=30),
        hooks={"release": shop.release, "notify": shop.notify},
        satisfy=pay_in_full,            # makes a guarded edge's guards hold, sometimes
        invariants=[paid_orders_are_charged],
    ).TestCase

:mod:`lifecycle.fuzzer` holds the machine and the list of rules it checks. The machines report
fast by default: no Hypothesis "explain" phase (which can take a minute on a stateful test)
unless ``explain=True``; :func:`fuzz_settings` builds settings the same way when you set your
own budget.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from lifecycle.fuzz_checks import CodeRaised, RuleBroken
from lifecycle.fuzzer import UNKNOWN_EVENT, Hooks, LifecycleMachine, MachineConfig, hooks_of
from lifecycle.prefill import PrefillRequest
from lifecycle.reasons import FailureReason
from lifecycle.table import Edge, LifecycleTable

__all__ = [
    "UNKNOWN_EVENT",
    "CodeRaised",
    "FakeClock",
    "LifecycleMachine",
    "MachineConfig",
    "RuleBroken",
    "event_sequences",
    "failure_reasons",
    "fuzz_settings",
    "legal_walks",
    "lifecycle_state_machine",
    "satisfy_prefill_guards",
]

# -- strategies ------------------------------------------------------------------------------


def _out_edges(table: LifecycleTable, state: enum.IntEnum) -> list[Edge]:
    return [e for e in table.edges if e.source is state]


@st.composite
def _walk(draw: st.DrawFn, table: LifecycleTable, max_steps: int) -> tuple[Edge, ...]:
    steps = draw(st.integers(min_value=0, max_value=max_steps))
    state, out = table.initial, []
    for _ in range(steps):
        if state in table.finals:
            break
        edge = draw(st.sampled_from(_out_edges(table, state)))
        out.append(edge)
        state = edge.dest
    return tuple(out)


def legal_walks(
    table: LifecycleTable, *, max_steps: int = 12
) -> st.SearchStrategy[tuple[Edge, ...]]:
    """Walks along the table's edges from its initial state (possibly ending early, stopping
    at a final state). Guards are not evaluated: the caller makes them hold."""
    return _walk(table, max_steps)


@st.composite
def _events(draw: st.DrawFn, table: LifecycleTable, max_steps: int) -> tuple[str, ...]:
    any_event = st.sampled_from((*map(str, table.events), UNKNOWN_EVENT))
    steps = draw(st.integers(min_value=0, max_value=max_steps))
    state, out = table.initial, []
    for _ in range(steps):
        legal = [str(e.event) for e in _out_edges(table, state)]
        event = draw(st.one_of(st.sampled_from(legal), any_event) if legal else any_event)
        out.append(event)
        edge = table.lookup.get((state, event))
        if edge is not None:
            state = edge.dest
    return tuple(out)


def event_sequences(
    table: LifecycleTable, *, max_steps: int = 12
) -> st.SearchStrategy[tuple[str, ...]]:
    """Event names to fire at one request: legal events mixed with illegal ones (events of
    other states, events after a final state, and :data:`UNKNOWN_EVENT`)."""
    return _events(table, max_steps)


def failure_reasons(table: LifecycleTable | None = None) -> st.SearchStrategy[Any]:
    """The failure reasons of ``table`` (``None`` if it declares none); without a table, the
    shipped tables' :class:`~lifecycle.reasons.FailureReason`."""
    if table is None:
        return st.sampled_from(FailureReason)
    if table.reasons is None:
        return st.none()
    return st.sampled_from(list(table.reasons))


def satisfy_prefill_guards(req: PrefillRequest, edge: Edge) -> None:
    """Make the guards of a prefill ``edge`` hold: ``prefilled`` needs the whole prompt
    computed, ``chunk_done`` a part of it (a prompt of at least two tokens)."""
    if edge.event == "prefilled":
        req.computed = len(req.input_ids)
    elif edge.event == "chunk_done":
        req.computed = min(req.computed + 1, len(req.input_ids) - 1)


# -- the stateful machine --------------------------------------------------------------------


class FakeClock:
    """A monotonic clock the test advances explicitly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fuzz_settings(*, explain: bool = False, **overrides: Any) -> settings:
    """Hypothesis settings for a lifecycle machine: the current profile, no deadline, and no
    explain phase unless ``explain``; ``overrides`` (``max_examples``,
    ``stateful_step_count``, ...) are passed on."""
    phases = tuple(p for p in Phase if explain or p is not Phase.explain)
    options: dict[str, Any] = {
        "deadline": None,
        "phases": phases,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
    }
    options.update(overrides)
    return settings(**options)


def lifecycle_state_machine(
    table: LifecycleTable,
    make_request: Callable[[str], Any],
    hooks: Hooks | None = None,
    *,
    satisfy: Callable[[Any, Edge], None] | None = None,
    invariants: Iterable[Callable[[Any], object]] = (),
    redraw_fields: bool = False,
    explain: bool = False,
) -> type[LifecycleMachine]:
    """A :class:`~lifecycle.fuzzer.LifecycleMachine` subclass for ``table``.

    ``make_request(rid)`` builds a fresh, unadmitted request record of the table's type; a
    class given here that another table was built for, when this table was built without
    ``record=``, is what the machine's lifecycles are given as their ``record=`` (so that it
    is admitted; told no class, they admit any, as a hook may admit a record of its own
    class). Requests the hooks admit are adopted and checked like the machine's own.
    ``hooks`` are the owner's hooks by name (each is wrapped to count its calls; hooks the
    table names but that are not given count only), or a function that makes them: it is
    called for every program, so an owner that keeps state of its own (which requests it
    released) starts afresh each time, as the programs' request ids do (``r1``, ``r2``, ...).
    ``satisfy(req, edge)`` makes ``edge``'s guards hold for ``req``; the machine calls it
    before some of the events it fires, so that guarded edges get taken as well as refused.
    ``invariants`` are checks of one record each, run on every request after every step (raise
    ``AssertionError`` or return ``False`` when broken). Without ``satisfy``,
    ``redraw_fields`` has the machine set the record's plain fields (numbers, strings,
    booleans, enums) to drawn values before some guarded events instead, drawing again (up to
    :data:`~lifecycle.fuzzer.REDRAWS` times) until the guards hold (what ``pdlife fuzz
    --load`` does). Use ``.TestCase`` of the result in pytest; its settings are
    :func:`fuzz_settings` (``explain`` turns Hypothesis's explain phase back on).
    """
    given: Hooks = hooks if callable(hooks) else dict(hooks or {})
    if not callable(given):
        hooks_of(table, given)  # refuse a wrong name now (a function's, in its first program)
    config = MachineConfig(table, make_request, given, satisfy, tuple(invariants), redraw_fields)
    name = f"{table.name.title().replace('_', '')}LifecycleMachine"
    machine: type[LifecycleMachine] = type(name, (LifecycleMachine,), {"config": config})
    machine.TestCase.settings = fuzz_settings(explain=explain)
    return machine
