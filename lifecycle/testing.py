"""Property-based testing of lifecycles: Hypothesis strategies and a stateful test machine.

Public API for embedders: point these at a table (the shipped ones, or your own) and the hooks
your service supplies, and Hypothesis will fire random legal and illegal events at a real
:class:`~lifecycle.machine.Lifecycle`, singly and in batches, checking the invariants after
every step::

    from lifecycle import PREFILL_TABLE, PrefillRequest
    from lifecycle.testing import lifecycle_state_machine, satisfy_prefill_guards

    Machine = lifecycle_state_machine(
        PREFILL_TABLE,
        lambda rid: PrefillRequest(rid, input_ids=list(range(8))),
        hooks={"release": my_release, "respond": my_respond},
        satisfy=satisfy_prefill_guards,
    )
    TestPrefillLifecycle = Machine.TestCase

Theory of operation
-------------------
The test machine keeps its own model of every request it admitted: the state the *table* says
it must be in (a dict lookup, independent of the machine under test). Each rule computes what
must happen from that model and the request's guards, fires, then checks the outcome: a legal
event moved the request (or the whole batch) to the edge's destination; an illegal one raised
:class:`~lifecycle.errors.LifecycleError` (:class:`~lifecycle.errors.IllegalTransition` for a
missing edge, :class:`~lifecycle.errors.GuardFailed` for a false guard) and changed nothing —
for a batch, no request of it. The invariants then hold after every step:

* every request is in the state the model says; at most one final state, entered once, last;
* every timeline replays through the table (only table edges) and is monotone;
* each hook ran exactly as often as the edges taken call for (``release``/``respond``: once
  per finished request, never for a live one);
* the lifecycle's state index equals the live requests' states (``check_index``), and its
  finished counters equal the finished requests by (state, reason).

:class:`LifecycleMachine` is the base class; larger machines (e.g. a whole scheduler) can
subclass it and add rules and invariants of their own.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lifecycle.errors import GuardFailed, IllegalTransition, LifecycleError
from lifecycle.invariants import expected_hook_calls, timeline_violations
from lifecycle.machine import Lifecycle, _guards_hold
from lifecycle.prefill import PrefillRequest
from lifecycle.reasons import FailureReason
from lifecycle.record import Tracked
from lifecycle.table import Edge, LifecycleTable

#: An event name no table defines; strategies mix it in as an always-illegal event.
UNKNOWN_EVENT = "no_such_event"

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
    any_event = st.sampled_from((*table.events, UNKNOWN_EVENT))
    steps = draw(st.integers(min_value=0, max_value=max_steps))
    state, out = table.initial, []
    for _ in range(steps):
        legal = [e.event for e in _out_edges(table, state)]
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


def failure_reasons() -> st.SearchStrategy[FailureReason]:
    return st.sampled_from(FailureReason)


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


@attrs.frozen
class MachineConfig:
    """What a :class:`LifecycleMachine` subclass is about."""

    table: LifecycleTable
    make_request: Callable[[str], Any]
    hooks: Mapping[str, Callable[[Any], None]] = attrs.field(factory=dict)
    satisfy: Callable[[Any, Edge], None] | None = None


@attrs.frozen
class _Snapshot:
    states: tuple[enum.IntEnum | None, ...]
    timelines: tuple[int, ...]
    reasons: tuple[FailureReason | None, ...]
    counts: dict[enum.IntEnum, int]
    finished: dict[tuple[enum.IntEnum, FailureReason | None], int]
    hook_calls: dict[str, dict[str, int]]
    fired: int


class LifecycleMachine(RuleBasedStateMachine):
    """Fires random events at a real :class:`Lifecycle`; see the module docstring.

    Subclasses set :attr:`config` (use :func:`lifecycle_state_machine`).
    """

    config: ClassVar[MachineConfig]

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        self.table = cfg.table
        self.clock = FakeClock()
        self.hook_calls: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.lifecycle: Lifecycle[Any] = Lifecycle(
            cfg.table, self._counting_hooks(cfg.hooks), clock=self.clock
        )
        # A second owner, so batches can be offered a request that is not ours.
        self.other: Lifecycle[Any] = Lifecycle(
            cfg.table, self._counting_hooks({}), clock=self.clock
        )
        self.requests: list[Any] = []
        self.model: dict[str, enum.IntEnum] = {}
        self.serial = 0

    def _counting_hooks(
        self, user: Mapping[str, Callable[[Any], None]]
    ) -> dict[str, Callable[[Any], None]]:
        def counting(name: str) -> Callable[[Any], None]:
            inner = user.get(name)

            def hook(req: Any) -> None:
                self.hook_calls[req.rid][name] += 1
                if inner is not None:
                    inner(req)

            return hook

        return {name: counting(name) for name in self.table.hooks()}

    # -- building blocks of the rules -------------------------------------------------------

    def _new(self) -> Any:
        self.serial += 1
        return self.config.make_request(f"r{self.serial}")

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            states=tuple(r.state for r in self.requests),
            timelines=tuple(len(r.timeline) for r in self.requests),
            reasons=tuple(r.reason for r in self.requests),
            counts=self.lifecycle.counts(),
            finished=dict(self.lifecycle.finished),
            hook_calls={k: dict(v) for k, v in self.hook_calls.items()},
            fired=self.lifecycle.transitions_fired,
        )

    def _draw_event(self, data: st.DataObject, state: enum.IntEnum) -> str:
        # Mostly the state's forward events (failure is easy to reach, depth is not), else any
        # event at all, including ones no table has.
        progress = [
            e.event
            for e in self.table.edges
            if e.source is state and e.event not in self.table.failure_events
        ]
        anything = st.sampled_from((*self.table.events, UNKNOWN_EVENT))
        if not progress:
            return data.draw(anything, label="event")
        forward = st.sampled_from(progress)
        return data.draw(st.one_of(forward, forward, forward, anything), label="event")

    def _reason_for(self, data: st.DataObject, event: str) -> FailureReason | None:
        return data.draw(failure_reasons()) if event in self.table.failure_events else None

    def _maybe_satisfy(self, data: st.DataObject, reqs: Sequence[Any], event: str) -> None:
        satisfy = self.config.satisfy
        if satisfy is None or not data.draw(st.booleans(), label="satisfy guards"):
            return
        for r in reqs:
            edge = self.table.lookup.get((self.model[r.rid], event))
            if edge is not None:
                satisfy(r, edge)

    def _moved(self, reqs: Sequence[Any], edge: Edge, before: int) -> None:
        fired = len(reqs)
        assert self.lifecycle.transitions_fired == before + fired
        for r in reqs:
            assert r.state is edge.dest, (r, edge)
            assert r.timeline[-1] == (self.clock.now, edge.event)
            self.model[r.rid] = edge.dest

    def _unchanged(self, before: _Snapshot) -> None:
        assert self._snapshot() == before

    # -- rules -----------------------------------------------------------------------------

    @rule(n=st.integers(min_value=1, max_value=4), data=st.data())
    def admit(self, n: int, data: st.DataObject) -> None:
        """Admit ``n`` new requests; then maybe admit a tracked request again, or a new one
        under a live id, which must fail and change nothing."""
        for _ in range(n):
            req = self._new()
            self.lifecycle.admit(req)
            assert req.state is self.table.initial
            assert req.timeline == [(self.clock.now, "")]
            self.requests.append(req)
            self.model[req.rid] = self.table.initial
        if not data.draw(st.booleans(), label="admit again"):
            return
        old = data.draw(st.sampled_from(self.requests))
        twin = self.config.make_request(old.rid)
        before = self._snapshot()
        for req in (old, twin) if old.rid in self.lifecycle else (old,):
            try:
                self.lifecycle.admit(req)
            except LifecycleError:
                pass
            else:
                raise AssertionError(f"admitting {req.rid!r} again was accepted")
        self._unchanged(before)

    def _tick(self, data: st.DataObject) -> None:
        self.clock.now += data.draw(st.sampled_from([0.0, 0.001, 0.5, 3.0]), label="dt")

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def fire_one(self, data: st.DataObject) -> None:
        """One event at one request (any state, finished ones too), by either path."""
        self._tick(data)
        live = list(self.lifecycle.live())
        pool = st.sampled_from(self.requests)
        req = data.draw(st.one_of(st.sampled_from(live), pool) if live else pool, label="request")
        event = self._draw_event(data, self.model[req.rid])
        reason = self._reason_for(data, event)
        self._maybe_satisfy(data, [req], event)
        edge = self.table.lookup.get((self.model[req.rid], event))
        # Guards are judged before firing: the edge's hooks may change what they read.
        allowed = edge is not None and _guards_hold(edge, req)
        batch_path = data.draw(st.booleans(), label="batch path")
        before = self._snapshot()
        try:
            if batch_path:
                self.lifecycle.fire(event, [req], reason=reason)
            else:
                self.lifecycle.trigger(req, event, reason=reason)
        except GuardFailed:
            assert edge is not None and not allowed
            self._unchanged(before)
            return
        except IllegalTransition:
            assert edge is None
            self._unchanged(before)
            return
        assert allowed and edge is not None, f"{event!r} was accepted"
        self._moved([req], edge, before.fired)
        if reason is not None:
            assert req.reason is reason

    @precondition(lambda self: len(self.lifecycle) > 0)
    @rule(data=st.data())
    def fire_batch(self, data: st.DataObject) -> None:
        """One event at a batch of requests that share a state, sometimes with an intruder
        (a request of another state, a finished one, a duplicate, another owner's)."""
        self._tick(data)
        live = [s for s, n in self.lifecycle.counts().items() if n]
        state = data.draw(st.sampled_from(live), label="state")
        members = list(self.lifecycle.in_state(state).values())
        # Often the whole state: batches are how the scheduler fires, and deep states fill
        # up with requests faster this way.
        batch = data.draw(
            st.just(members)
            | st.lists(st.sampled_from(members), min_size=1, max_size=8, unique_by=id),
            label="batch",
        )
        intruder = data.draw(
            st.sampled_from(["none", "none", "other_state", "duplicate", "foreign"]),
            label="intruder",
        )
        if intruder == "other_state":
            others = [r for r in self.requests if self.model[r.rid] is not state]
            if others:
                at = data.draw(st.integers(0, len(batch)))
                batch.insert(at, data.draw(st.sampled_from(others)))
            else:
                intruder = "none"
        elif intruder == "duplicate":
            batch.append(batch[0])
        elif intruder == "foreign":
            stranger = self._new()
            self.other.admit(stranger)
            if stranger.state is state:
                batch.insert(data.draw(st.integers(0, len(batch))), stranger)
            else:
                intruder = "none"
        event = self._draw_event(data, state)
        reason = self._reason_for(data, event)
        self._maybe_satisfy(data, [r for r in batch if r.rid in self.model], event)
        edge = self.table.lookup.get((state, event))
        legal = (
            intruder == "none"
            and edge is not None
            and all(_guards_hold(edge, r) for r in batch)
        )
        before = self._snapshot()
        try:
            self.lifecycle.fire(event, batch, reason=reason)
        except LifecycleError:
            assert not legal, f"a legal batch of {event!r} was refused"
            self._unchanged(before)
            return
        assert legal and edge is not None, f"an illegal batch of {event!r} was accepted"
        self._moved(batch, edge, before.fired)

    @precondition(lambda self: len(self.lifecycle) > 0 and bool(self.table.failure_events))
    @rule(data=st.data())
    def fail_many(self, data: st.DataObject) -> None:
        """A failure event for live requests of any mix of states."""
        live = list(self.lifecycle.live())
        victims = data.draw(
            st.lists(st.sampled_from(live), min_size=1, max_size=3, unique_by=id)
        )
        event = data.draw(st.sampled_from(self.table.failure_events))
        reason = data.draw(failure_reasons())
        self.lifecycle.fail(victims, reason, "injected", event=event)
        for r in victims:
            assert r.reason is reason and r.detail == "injected"
            self.model[r.rid] = self.table.lookup[(self.model[r.rid], event)].dest
            assert r.state is self.model[r.rid]

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def states_match_the_model(self) -> None:
        for r in self.requests:
            assert r.state is self.model[r.rid], (r, self.model[r.rid])

    @invariant()
    def index_matches_states(self) -> None:
        self.lifecycle.check_index()
        live: list[Tracked] = [r for r in self.requests if r.state not in self.table.finals]
        assert len(self.lifecycle) == len(live)
        for r in live:
            assert r.state is not None
            assert self.lifecycle.in_state(r.state).get(r.rid) is r
            assert self.lifecycle.get(r.rid) is r

    @invariant()
    def timelines_replay(self) -> None:
        for r in self.requests:
            assert timeline_violations(r, self.table) == []

    @invariant()
    def hooks_ran_as_the_edges_say(self) -> None:
        for r in self.requests:
            assert self.hook_calls.get(r.rid, collections.Counter()) == expected_hook_calls(
                r, self.table
            ), r.rid

    @invariant()
    def finished_counters(self) -> None:
        done = collections.Counter(
            (r.state, r.reason) for r in self.requests if r.state in self.table.finals
        )
        assert +self.lifecycle.finished == done


def lifecycle_state_machine(
    table: LifecycleTable,
    make_request: Callable[[str], Any],
    hooks: Mapping[str, Callable[[Any], None]] | None = None,
    *,
    satisfy: Callable[[Any, Edge], None] | None = None,
) -> type[LifecycleMachine]:
    """A :class:`LifecycleMachine` subclass for ``table``.

    ``make_request(rid)`` builds a fresh, unadmitted request record of the table's type.
    ``hooks`` are the owner's hooks by name (each is wrapped to count its calls; hooks the
    table names but that are not given count only). ``satisfy(req, edge)`` makes ``edge``'s
    guards hold for ``req``; the machine calls it before some of the events it fires, so that
    guarded edges get taken as well as refused. Use ``.TestCase`` of the result in pytest.
    """
    config = MachineConfig(table, make_request, dict(hooks or {}), satisfy)
    name = f"{table.name.title().replace('_', '')}LifecycleMachine"
    return type(name, (LifecycleMachine,), {"config": config})
