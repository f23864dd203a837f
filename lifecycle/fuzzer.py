"""The stateful test machine behind :func:`lifecycle.testing.lifecycle_state_machine`.

Theory of operation
-------------------
The machine keeps its own model of every request it admitted: the state the *table* says it
must be in (a dict lookup, independent of the machine under test). Each rule computes what must
happen from that model and the request's guards, fires, then checks the outcome: a legal event
moved the request (or the whole batch) to the edge's destination; an illegal one raised
:class:`~lifecycle.errors.IllegalTransition` (:class:`~lifecycle.errors.GuardFailed` for a
guard that refused) and changed nothing — for a batch, no request of it.

It checks the framework *and* the embedder's code:

* **guards are pure** — before an event is fired, its guards are evaluated twice on the same
  record: the same answer both times, and no field of the record changed;
* **one evaluation per guard** — firing evaluates each guard at most once per request (the
  refusal message comes from that evaluation);
* **once-hooks run exactly once** — every hook the table lists in ``once`` (its resource hooks)
  ran at most once for a live request and exactly once for a finished one, counting every call,
  from ``after`` and ``on_enter`` alike, whatever edges the table gives them;
* **hooks do not raise**, and each ran as often as the edges taken call for;
* the index, the finished counters, the timelines (only table edges, monotone) agree with the
  model, and the embedder's own ``invariants`` hold for every request after every step. (The
  per-request rules are checked for every request a step can have changed: those it fired at,
  those a hook moved, and every live one, at which a hook may have fired.)

A hook may fire events at other requests than those of the call running it (the lifecycle
refuses only those), so a step can move requests no rule fired at. After each call the machine
follows them: the entries their timelines gained are replayed through the table from where its
model has them (each must be an edge), the model moves with them, and they count as touched,
so every per-request rule is checked for them, and the step's counters allow for their moves;
the program shows them on the step that fired them (``fire finish [r1] -> DONE; from hooks: r3
merge -> MERGED``). The guards such events evaluate, and any a hook asks ``refusal`` about,
are counted apart from the rule's own (:class:`~lifecycle.fuzz_checks.InHooks`).

A hook may also admit requests (a child: a retry, a refund, a follow-up). The machine's
lifecycle keeps the records admitted to it (:class:`_Watched`), and after each call the machine
*adopts* those it did not admit itself: each one's timeline is replayed through the table from
the initial state (it may have been moved already, by events hooks fired in the same call),
the model takes it where that leads, it counts as touched, and from then on it is one of the
machine's requests: every rule is checked for it and the rules fire at it as at the others.
The program shows it on the step that admitted it (``fire cancel [r1] -> CANCELLED; from
hooks: admit r1-refund, r1-refund open -> REFUNDING``). The machine names a request by its id;
a record a hook admits under the id of one the machine has (an ended request retried as a new
record of the same id) is named ``id#2`` (``#3``, ...), and the hook counts go by record, not
by id. The machine builds records only of its own requests (``make_request``): an adopted one,
of whatever class its hook made, is never rebuilt.

How it searches: the rules admit requests (while fewer than :data:`LIVE_AT_MOST` are live),
fire an event at one request or a batch of one state, fail a few at once, and *walk* one
request several events on (:meth:`LifecycleMachine.walk`). Half the event draws are among the
steps the program has not taken yet, a step being (the event the request arrived by, its state,
the event): paths, not only edges, so a loop's second lap is new. Hypothesis is asked to favour
programs that take more distinct steps (:meth:`LifecycleMachine.teardown`).

A broken rule raises :class:`RuleBroken`, whose message names the rule, then shows the event
program of the failing run (Hypothesis shrinks it first) and the timeline of the request
concerned; it holds names and states, never reprs of records. The code under test raising (the
record class, a guard, ``satisfy``) raises :class:`~lifecycle.fuzz_checks.CodeRaised`, with the
same program and timeline and the exception as its ``__cause__``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis import target
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from lifecycle.errors import GuardFailed, HookFailed, IllegalTransition, LifecycleError, MissingHook
from lifecycle.fuzz_checks import (
    CodeRaised,
    InHooks,
    MachineInvariants,
    RuleBroken,
    Snapshot,
    counting_hooks,
    raised,
    record_fields,
    redraw_fields,
    report,
)
from lifecycle.machine import Lifecycle
from lifecycle.record import ADMITTED
from lifecycle.table import Edge, LifecycleTable, tables_for
from lifecycle.validators import typed_fields
from lifecycle.weak import PerObject

#: An event name no table defines; the machine mixes it in as an always-illegal event.
UNKNOWN_EVENT = "no_such_event"
#: Admission pauses while this many requests are live: a program's steps go to moving requests
#: deep into the table rather than to admitting ever more of them.
LIVE_AT_MOST = 6
#: How many times the machine redraws a record's fields looking for values its guards take.
REDRAWS = 8

# Strategies built once (building one per draw is most of a step's cost).
_BOOLEANS = st.booleans()
_MOSTLY = st.sampled_from((True, True, True, False))
_TICKS = st.sampled_from((0.0, 0.001, 0.5, 3.0))
_INTRUDERS = st.sampled_from(("none", "none", "other_state", "duplicate", "foreign"))
# Per table, while it lives (lifecycle.weak): its strategies by key, and by (state, forward)
# the events of its edges from a state, built on first use.
_TABLE_STRATEGIES: PerObject[LifecycleTable, dict[Any, st.SearchStrategy[Any]]] = PerObject()
_EVENTS_FROM: PerObject[LifecycleTable, dict[tuple[enum.IntEnum, bool], tuple[str, ...]]] = (
    PerObject())


#: An owner's hooks by name, or a function returning them (called once per program).
Hooks = Mapping[str, Callable[..., None]] | Callable[[], Mapping[str, Callable[..., None]]]


def hooks_of(table: LifecycleTable, hooks: Hooks) -> Mapping[str, Callable[..., None]]:
    """``hooks`` (made afresh when given as a function), checked against the names of
    ``table``'s hooks: :class:`~lifecycle.errors.MissingHook` for a name it does not use."""
    given = hooks() if callable(hooks) else hooks
    unknown = sorted(set(given) - table.hooks())
    if unknown:
        raise MissingHook(f"{table.name}: hooks given that the table does not name: {unknown}")
    return given


class _Watched(Lifecycle[Any]):
    """The machine's lifecycle: a :class:`Lifecycle` that also lists the records admitted to
    it, for the machine to adopt those its hooks admitted (``admitted``, which it empties)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admitted: list[Any] = []

    def admit(self, req: Any) -> None:
        super().admit(req)
        self.admitted.append(req)  # not reached when it is refused


@attrs.frozen(field_transformer=typed_fields)
class MachineConfig:
    """What a :class:`LifecycleMachine` subclass is about."""

    table: LifecycleTable
    make_request: Callable[[str], Any]
    #: The hooks by name, or a function that makes them afresh for every program.
    hooks: Hooks = attrs.field(factory=dict)
    satisfy: Callable[[Any, Edge], None] | None = None
    invariants: tuple[Callable[[Any], object], ...] = ()
    redraw_fields: bool = False


class LifecycleMachine(MachineInvariants, RuleBasedStateMachine):
    """Fires random events at a real :class:`Lifecycle`; see the module docstring.

    Subclasses set :attr:`config` (use :func:`lifecycle.testing.lifecycle_state_machine`).
    """

    config: ClassVar[MachineConfig]

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        self.table = cfg.table
        self.now = 0.0
        self.program: list[str] = []
        self.attempt = ""  # the step under way, until its outcome is in the program
        self.hook_calls: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        clock = lambda: self.now  # noqa: E731 - the machine moves time itself
        # Per record (by identity, the record kept alive here), the machine's name for it;
        # and the names given. A record's hooks may run before it is adopted (a hook admits
        # it, then fires at it), so it is named on first sight.
        self._names: dict[int, tuple[Any, str]] = {}
        self._named: set[str] = set()
        #: The requests hooks admitted (their names): the machine did not build them.
        self.adopted: set[str] = set()
        self.in_hooks = InHooks(lambda: self.lifecycle.guards_evaluated)
        hooks = counting_hooks(cfg.table, hooks_of(cfg.table, cfg.hooks), self.hook_calls,
                               self.in_hooks, key=self.name_of)
        # A class given to make the records, when the table names none, is what the
        # lifecycles are for if another table was built for it (``pdlife fuzz --record``):
        # such a class is admitted only to a lifecycle told so. Any other class, a lifecycle
        # told nothing admits, as it admits the records of other classes that hooks admit.
        make = cfg.make_request
        record = make if (cfg.table.record is None and isinstance(make, type)
                          and tables_for(make)) else None
        self.lifecycle: _Watched = _Watched(cfg.table, hooks, clock=clock, record=record)
        # A second owner, so batches can be offered a request that is not ours.
        others = counting_hooks(cfg.table, {}, self.hook_calls)
        self.other: Lifecycle[Any] = Lifecycle(cfg.table, others, clock=clock, record=record)
        #: The machine's requests and those it adopted, by name (see :meth:`name_of`).
        self.requests: dict[str, Any] = {}
        self.model: dict[str, enum.IntEnum] = {}
        # Coverage of the program: the event that brought each request to its state, and the
        # (arrived by, state, event) steps taken so far, which the machine favours not taken.
        self.arrived: dict[str, str] = {}
        self.taken: set[tuple[str, enum.IntEnum, str]] = set()
        self.checks = cfg.invariants
        self.touched: set[str] = set()
        self.serial = 0
        self._strategies = _TABLE_STRATEGIES.setdefault(cfg.table, {})
        self._events = _EVENTS_FROM.setdefault(cfg.table, {})

    def teardown(self) -> None:
        """Steer Hypothesis's search toward programs that take more distinct steps (its
        targeted phase mutates the best programs so far): coverage of paths, not only of
        edges, as :meth:`_draw_event` counts it."""
        target(float(len(self.taken)), label="steps covered")

    def _done(self, step: str) -> None:
        self.program.append(step)
        self.attempt = ""

    def broken(self, rule_name: str, message: str, rid: str | None = None) -> RuleBroken:
        """The error for a broken rule, with the program so far and ``rid``'s timeline."""
        req = self.requests.get(rid) if rid is not None else None
        steps = [*self.program, f"{self.attempt}   <- here"] if self.attempt else self.program
        return report(rule_name, message, steps, req, self.table, rid)

    def name_of(self, req: Any) -> str:
        """The machine's name for ``req``: its id, unless the machine named another record so
        (a hook admitted a new record under an ended request's id), then ``id#2``, ``#3``..."""
        known = self._names.get(id(req))
        if known is not None and known[0] is req:
            return known[1]
        name: str = req.rid
        n = 1
        while name in self._named:
            n += 1
            name = f"{req.rid}#{n}"
        self._names[id(req)] = (req, name)
        self._named.add(name)
        return name

    @contextlib.contextmanager
    def _code_under_test(self, what: str, rid: str | None = None) -> Iterator[None]:
        """Turn an exception of the code under test (not the framework's refusals, nor a broken
        rule) into :class:`~lifecycle.fuzz_checks.CodeRaised`, with the program so far."""
        try:
            yield
        except (LifecycleError, RuleBroken, CodeRaised):
            raise
        except Exception as exc:
            req = self.requests.get(rid) if rid is not None else None
            steps = [*self.program, f"{self.attempt}   <- here"] if self.attempt else self.program
            raise raised(f"{what} raised {type(exc).__name__}: {exc}", steps, req,
                         self.table, rid) from exc

    # -- building blocks of the rules -------------------------------------------------------

    def _new(self) -> Any:
        """A new record, named by the next id ``r<n>`` that names no request (a hook may have
        admitted one under such an id)."""
        self.serial += 1
        while f"r{self.serial}" in self._named:
            self.serial += 1
        req = self._make(f"r{self.serial}")
        self.name_of(req)
        return req

    def _make(self, rid: str) -> Any:
        with self._code_under_test(f"building the record {rid}"):
            return self.config.make_request(rid)

    def _snapshot(self) -> Snapshot:
        return Snapshot.of(self.requests.values(), self.lifecycle, self.hook_calls)

    def _unchanged(self, before: Snapshot, what: str) -> None:
        if self._snapshot() != before:
            raise self.broken("a refused event changes nothing", f"{what} changed the state")

    def _draw_event(self, data: st.DataObject, state: enum.IntEnum, rids: Sequence[str], *,
                    walk: str | None = None) -> str:
        """An event for requests ``rids`` of ``state``: mostly the state's forward events
        (failure is easy to reach, depth is not), else any event at all, including one no table
        has; on a walk (:meth:`walk`), a forward event before its ``"last"`` step, then any
        event with an edge from ``state``. Half the time the draw is among those of the
        candidates not yet taken in this program by a request that arrived as one of ``rids``
        did: a loop's second lap, a failure after a retry (paths, not only edges, are what bugs
        need)."""
        forward = self._events_from(state, forward=True)
        if walk is None:
            candidates = self._events_from(state)
            strategy = self._strategies.get(("event", state))
            if strategy is None:
                anything = st.sampled_from((*map(str, self.table.events), UNKNOWN_EVENT))
                ahead = self._among(forward) if forward else anything
                strategy = st.one_of(ahead, ahead, ahead, anything)
                self._strategies[("event", state)] = strategy
        else:
            candidates = forward if walk != "last" and forward else self._events_from(state)
            strategy = self._among(candidates)
        arrivals = {self.arrived[r] for r in rids if r in self.arrived}
        fresh = tuple(e for e in candidates
                      if any((a, state, e) not in self.taken for a in arrivals))
        # Drawn whether or not anything is unexplored, so that the choices of a program keep
        # their places when the shrinker deletes a step before them; it shrinks to False.
        if data.draw(_BOOLEANS, label="unexplored") and fresh:
            strategy = self._among(fresh)
        event: str = data.draw(strategy, label="event")
        return event

    def _among(self, events: tuple[str, ...]) -> st.SearchStrategy[str]:
        strategy = self._strategies.get(events)
        if strategy is None:
            strategy = self._strategies[events] = st.sampled_from(events)
        return strategy

    def _events_from(self, state: enum.IntEnum, *, forward: bool = False) -> tuple[str, ...]:
        """The events with an edge from ``state``, in table order: those of failure events
        too, unless ``forward``."""
        events = self._events.get((state, forward))
        if events is None:
            events = self._events[(state, forward)] = tuple(dict.fromkeys(
                str(e.event) for e in self.table.edges if e.source is state
                and not (forward and e.event in self.table.failure_events)))
        return events

    def _took(self, rid: str, state: enum.IntEnum, event: str) -> None:
        """``rid`` left ``state`` by ``event``: a step of the program's coverage."""
        self.taken.add((self.arrived.get(rid, ADMITTED), state, event))
        self.arrived[rid] = event

    def _draw_reason(self, data: st.DataObject) -> enum.Enum | None:
        if self.table.reasons is None:
            return None
        strategy = self._strategies.get("reason")
        if strategy is None:
            strategy = st.none() | st.sampled_from(list(self.table.reasons))
            self._strategies["reason"] = strategy
        reason: enum.Enum | None = data.draw(strategy, label="reason")
        return reason

    def _maybe_satisfy(self, data: st.DataObject, reqs: Sequence[Any], event: str, *,
                       always: bool = False) -> None:
        satisfy, redraw = self.config.satisfy, self.config.redraw_fields
        if (satisfy is None and not redraw) or not (always or data.draw(_MOSTLY,
                                                                         label="satisfy")):
            return
        for r in reqs:
            name = self.name_of(r)
            edge = self.table.lookup.get((self.model[name], event))
            if edge is None:
                continue
            if satisfy is not None:
                # One that raises is reported on this step, marked as the step under way (as a
                # guard that raises is): the event it prepared is not in the program yet.
                what = f"satisfy({name}, {edge.event})"
                before, self.attempt = self.attempt, what
                with self._code_under_test(what, name):
                    satisfy(r, edge)
                self.attempt = before
            elif edge.guarded:
                self._redraw(data, r, edge)

    def _redraw(self, data: st.DataObject, req: Any, edge: Edge) -> None:
        """Draw ``req``'s plain fields until ``edge``'s guards hold, at most :data:`REDRAWS`
        times (drawn values rarely make a guard hold on the first try, and a request past a
        guarded edge is deeper in its table, where bugs hide); the program shows the last."""
        name = self.name_of(req)
        for _ in range(REDRAWS):
            with self._code_under_test(f"setting the fields of {name}", name):
                drawn = redraw_fields(data, req)  # a record's on_setattr hooks may raise
            self.attempt = f"{name}: fields set to {drawn}"
            if req.owner is not self.lifecycle:
                break
            # A guard that raises here is reported on this step, as the one evaluating it.
            set_to, self.attempt = self.attempt, (f"{self.attempt}; the guards of "
                                                  f"{_guarding(edge)} evaluated")
            with self._code_under_test(f"a guard of {_guarding(edge)} on {name}", name):
                if not self.lifecycle.refusal(req, edge.event):
                    self.attempt = set_to
                    break
            self.attempt = set_to
        self._done(self.attempt)

    def _pure_refusal(self, req: Any, event: str, edge: Edge | None) -> str:
        """Why ``event`` would be refused for ``req``, checking that its guards are pure."""
        if edge is None or not edge.guarded or req.owner is not self.lifecycle:
            return "" if edge is not None else "no edge"
        name = self.name_of(req)
        before = record_fields(req)
        with self._code_under_test(f"a guard of {_guarding(edge)} on {name}", name):
            first: str = self.lifecycle.refusal(req, event)
            after = record_fields(req)
            second: str = self.lifecycle.refusal(req, event)
        changed = [k for k in before if before[k] != after.get(k)]
        if changed:
            raise self.broken(
                "guards are pure",
                f"evaluating the guards of {_guarding(edge)} on {name} changed its "
                f"{', '.join(changed)}",
                name,
            )
        if first != second:
            raise self.broken(
                "guards are pure",
                f"the guards of {_guarding(edge)} answered differently when evaluated "
                f"twice on {name}: {first or 'allowed'}, then {second or 'allowed'}",
                name,
            )
        return first

    def _fire(self, fire: Callable[[], None], reqs: Sequence[Any], edge: Edge | None) -> None:
        """Run ``fire``, checking it evaluated each guard at most once per request and that no
        hook raised; exceptions other than a hook's propagate."""
        evaluated, in_hooks = self.lifecycle.guards_evaluated, self.in_hooks.guards
        failed: HookFailed | None = None
        first = self.name_of(reqs[0])
        try:
            with self._code_under_test(f"firing {edge.event if edge else 'an event'}", first):
                fire()
        except HookFailed as exc:
            failed = exc  # reported below, outside this handler: with no exception context,
            # a hook failing under any rule is one failure to Hypothesis, not one per rule
        finally:
            # Not counting those of events the hooks fired at other requests.
            used = (self.lifecycle.guards_evaluated - evaluated
                    - (self.in_hooks.guards - in_hooks))
            most = len(reqs) * (len(edge.conditions) + len(edge.unless)) if edge else 0
            if used > most:
                raise self.broken(
                    "one evaluation per guard",
                    f"firing {edge.event if edge else '?'} at {len(reqs)} request(s) evaluated "
                    f"guards {used} times; at most {most}",
                    first,
                )
        if failed is not None:
            rid, hook, error = failed.errors[0]  # one of the call's requests
            name = next((self.name_of(r) for r in reqs if r.rid == rid), rid)
            raise self.broken(
                "hooks do not raise",
                f"hook {hook!r} raised for {name}: {type(error).__name__}: {error}",
                name,
            )

    def _follow_hooks(self, before: Snapshot, fired: Sequence[Any]) -> int:
        """Follow in the model what hooks did, while the call that fired at ``fired`` ran, to
        other requests (the lifecycle fires those events as usual): the events they fired,
        from the entries the timelines gained since ``before``, each of which must be an edge
        of the table from where the model has the request; and the requests they admitted,
        which the machine adopts (:meth:`_adopt`). A request so moved or adopted counts as
        touched, so that every per-request rule is checked for it (its once-hooks, when such
        an event ended it). The program's last step, the one that ran the hooks, shows it.
        How many moves were followed."""
        ours = {id(r) for r in fired}
        moves: list[str] = []
        followed = 0
        for (name, r), length in zip(self.requests.items(), before.timelines, strict=False):
            if id(r) not in ours:  # none of the call's requests can take an event from its hooks
                followed += self._replay(name, r.timeline[length:], moves)
        followed += self._adopt(moves)
        if moves:
            self.program[-1] += f"; from hooks: {', '.join(moves)}"
        return followed

    def _adopt(self, moves: list[str]) -> int:
        """Make the requests hooks admitted since the last call the machine's: named (the
        name their hooks were counted by), in the model where their timelines lead from the
        initial state (a hook may have fired at them since), touched; each listed in
        ``moves``, with the moves replayed. How many moves were replayed."""
        admitted, self.lifecycle.admitted = self.lifecycle.admitted, []
        followed = 0
        for r in admitted:
            name = self.name_of(r)
            if self.requests.get(name) is r:
                continue  # admitted by the machine's own rule
            self.requests[name] = r
            self.model[name] = self.table.initial
            self.arrived[name] = ADMITTED
            self.adopted.add(name)
            self.touched.add(name)
            moves.append(f"admit {name}" if name == r.rid else
                         f"admit {name} (a new record of id {r.rid})")
            followed += self._replay(name, r.timeline[1:], moves)
        return followed

    def _replay(self, name: str, entries: Sequence[tuple[float, str]], moves: list[str]) -> int:
        """Move the model of request ``name`` by the events of timeline ``entries``, fired
        from hooks, listing each in ``moves``; how many."""
        for _, event in entries:
            state = self.model[name]
            edge = self.table.lookup.get((state, event))
            if edge is None:
                raise self.broken(
                    "timelines replay through the table",
                    f"{name} took {event} from {state.name}, fired from a hook, and the "
                    f"table has no such edge", name)
            self._took(name, state, str(event))
            self.model[name] = edge.dest
            self.touched.add(name)
            moves.append(f"{name} {event} -> {edge.dest.name}")
        return len(entries)

    def _moved(self, reqs: Sequence[Any], edge: Edge, before: int) -> None:
        """``reqs`` took ``edge``, ``before`` being what ``transitions_fired`` was before
        (and the moves hooks made since, followed by :meth:`_follow_hooks`)."""
        if self.lifecycle.transitions_fired != before + len(reqs):
            raise self.broken("the counters count", "transitions_fired did not grow by the batch")
        for r in reqs:
            name = self.name_of(r)
            if r.state is not edge.dest or tuple(r.timeline[-1]) != (self.now, edge.event):
                raise self.broken(
                    "a legal event moves", f"{name} is not in {edge.dest.name} after "
                    f"{edge.event}", name,
                )
            self._took(name, self.model[name], str(edge.event))
            self.model[name] = edge.dest

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.lifecycle) < LIVE_AT_MOST)
    @rule(n=st.integers(min_value=1, max_value=4), data=st.data())
    def admit(self, n: int, data: st.DataObject) -> None:
        """Admit ``n`` new requests; then maybe admit a tracked request again, or a new one
        under a live id, which must fail and change nothing."""
        new: list[str] = []
        self.touched = set()
        for _ in range(n):
            req = self._new()
            name = self.name_of(req)
            self.lifecycle.admit(req)
            if req.state is not self.table.initial or req.timeline != [(self.now, ADMITTED)]:
                raise self.broken("admission", f"{name} was not admitted", name)
            self.requests[name] = req
            self.model[name] = self.table.initial
            self.arrived[name] = ADMITTED
            new.append(name)
            self.touched.add(name)
        self._done(f"admit {', '.join(new)}")
        if not data.draw(_BOOLEANS, label="admit again"):
            return
        rid = data.draw(st.sampled_from(sorted(self.requests)), label="again")
        old = self.requests[rid]
        before = self._snapshot()
        # A new record under a live id, of the machine's own requests only: it builds the
        # records of those (an adopted one's id, ``make_request`` may not take).
        fresh = rid not in self.adopted and self.lifecycle.get(old.rid) is old
        for req in (old, self._make(rid)) if fresh else (old,):
            try:
                self.lifecycle.admit(req)
            except LifecycleError:
                continue
            raise self.broken("admission", f"admitting {rid} again was accepted", rid)
        self._done(f"admit {rid} again: refused")
        self._unchanged(before, f"admitting {rid} again")

    def _tick(self, data: st.DataObject) -> None:
        self.now += data.draw(_TICKS, label="dt")

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def fire_one(self, data: st.DataObject) -> None:
        """One event at one request (any state, finished ones too), by either path."""
        self.touched = set()
        live = sorted(self.name_of(r) for r in self.lifecycle.live())
        every = st.sampled_from(sorted(self.requests))
        rid = data.draw(st.one_of(st.sampled_from(live), every) if live else every, label="rid")
        self._fire_at(data, rid)

    @precondition(lambda self: len(self.lifecycle) > 0)
    @rule(data=st.data(), steps=st.integers(min_value=2, max_value=8))
    def walk(self, data: st.DataObject, steps: int) -> None:
        """Events in a row at one live request until it finishes or ``steps`` are fired, the
        invariants checked after each: depth for few rules (the other rules spread a program
        over many requests, and a path such as a failure after a loop's second lap needs one
        request taken far)."""
        rid = data.draw(st.sampled_from(sorted(self.name_of(r) for r in self.lifecycle.live())),
                        label="walker")
        for step in range(steps):
            if step:
                self.check_every_invariant()
            if self.model[rid] in self.table.finals:
                return
            self.touched = set()
            self._fire_at(data, rid, walk="last" if step == steps - 1 else "on")

    def _fire_at(self, data: st.DataObject, rid: str, *, walk: str | None = None) -> None:
        """One event at ``rid``, by either path, checked against the model; on a ``walk``, an
        event of the state's edges (:meth:`_draw_event`), with the guards satisfied where the
        machine can."""
        self._tick(data)
        req = self.requests[rid]
        self.touched.add(rid)
        event = self._draw_event(data, self.model[rid], [rid], walk=walk)
        reason = self._draw_reason(data) if event in self.table.failure_events else None
        self._maybe_satisfy(data, [req], event, always=walk is not None)
        edge = self.table.lookup.get((self.model[rid], event))
        one_by_one = data.draw(_BOOLEANS, label="one by one")
        how = self.attempt = f"{rid}.{event}()" if one_by_one else f"fire {event} [{rid}]"
        refusal = self._pure_refusal(req, event, edge)
        before = self._snapshot()
        try:
            if one_by_one:
                self._fire(lambda: self.lifecycle.trigger(req, event, reason=reason), [req], edge)
            else:
                self._fire(lambda: self.lifecycle.fire(event, [req], reason=reason), [req], edge)
        except GuardFailed as exc:
            self._done(f"{how}: refused, {exc.why}")
            if edge is None or not refusal or exc.why != refusal:
                raise self.broken("guards decide", f"{how} was refused: {exc.why}", rid) from None
            self._unchanged(before, how)
            return
        except IllegalTransition:
            self._done(f"{how}: refused, {self.model[rid].name} has no such edge")
            if edge is not None:
                raise self.broken("table edges are taken", f"{how} was refused", rid) from None
            self._unchanged(before, how)
            return
        self._done(f"{how} -> {req.state.name}")
        if edge is None or refusal:
            raise self.broken("illegal events are refused", f"{how} was accepted", rid)
        self._moved([req], edge, before.fired + self._follow_hooks(before, [req]))

    def _batch(self, data: st.DataObject, state: enum.IntEnum) -> tuple[list[Any], str]:
        members = sorted(self.name_of(r) for r in self.lifecycle.in_state(state).values())
        # Often the whole state: batches are how a scheduler fires, and deep states fill up
        # with requests faster this way.
        rids = data.draw(
            st.just(members) | st.lists(st.sampled_from(members), min_size=1, max_size=8,
                                        unique=True),
            label="batch",
        )
        batch = [self.requests[r] for r in rids]
        intruder = data.draw(
            _INTRUDERS,
            label="intruder",
        )
        if intruder == "other_state":
            others = sorted(r for r in self.requests if self.model[r] is not state)
            if not others:
                return batch, "none"
            batch.insert(data.draw(st.integers(0, len(batch))),
                         self.requests[data.draw(st.sampled_from(others))])
        elif intruder == "duplicate":
            batch.append(batch[0])
        elif intruder == "foreign":
            stranger = self._new()
            self.other.admit(stranger)
            if stranger.state is not state:
                return batch, "none"
            batch.insert(data.draw(st.integers(0, len(batch))), stranger)
        return batch, intruder

    @precondition(lambda self: len(self.lifecycle) > 0)
    @rule(data=st.data())
    def fire_batch(self, data: st.DataObject) -> None:
        """One event at a batch of requests that share a state, sometimes with an intruder
        (a request of another state, a finished one, a duplicate, another owner's)."""
        self.touched = set()
        self._tick(data)
        live = [s for s, n in self.lifecycle.counts().items() if n]
        state = data.draw(st.sampled_from(live), label="state")
        batch, intruder = self._batch(data, state)
        names = [self.name_of(r) for r in batch]
        self.touched = set(names)
        event = self._draw_event(data, state, names)
        reason = self._draw_reason(data) if event in self.table.failure_events else None
        ours = [r for r, name in zip(batch, names, strict=True) if self.requests.get(name) is r]
        self._maybe_satisfy(data, ours, event)
        edge = self.table.lookup.get((state, event))
        how = f"fire {event} [{', '.join(names)}]"
        if intruder != "none":
            how += f" ({intruder.replace('_', ' ')} intruder)"
        self.attempt = how
        legal = intruder == "none" and edge is not None and not any(
            [self._pure_refusal(r, event, edge) for r in ours]
        )
        before = self._snapshot()
        # The lifecycle takes the edge of the batch's first request, an intruder's perhaps, and
        # may evaluate its guard before it finds the batch mixed: bound the evaluations by it.
        first = batch[0].state
        tried = None if first is None else self.table.lookup.get((first, event))
        try:
            self._fire(lambda: self.lifecycle.fire(event, batch, reason=reason), batch, tried)
        except LifecycleError as exc:
            self._done(f"{how}: refused")
            if legal:
                raise self.broken("legal batches move", f"{how} was refused: {exc}") from None
            self._unchanged(before, how)
            return
        self._done(f"{how} -> {edge.dest.name if edge else '?'}")
        if not legal or edge is None:
            raise self.broken("illegal batches are refused", f"{how} was accepted")
        self._moved(batch, edge, before.fired + self._follow_hooks(before, batch))

    @precondition(lambda self: len(self.lifecycle) > 0 and bool(self.table.failure_events))
    @rule(data=st.data())
    def fail_many(self, data: st.DataObject) -> None:
        """A failure event for live requests of any mix of states."""
        live = sorted(self.name_of(r) for r in self.lifecycle.live())
        rids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True),
                         label="victims")
        event = data.draw(st.sampled_from([str(e) for e in self.table.failure_events]),
                          label="failure event")
        reason = self._draw_reason(data)
        victims = [self.requests[r] for r in rids]
        self.touched = set(rids)
        self.attempt = f"fail [{', '.join(rids)}] by {event}"
        before = self._snapshot()
        self._fire(lambda: self.lifecycle.fail(victims, reason, "injected", event=event),
                   victims, None)
        self._done(self.attempt)
        self._follow_hooks(before, victims)
        for name, r in zip(rids, victims, strict=True):
            self._took(name, self.model[name], event)
            self.model[name] = self.table.lookup[(self.model[name], event)].dest
            if r.state is not self.model[name] or r.detail != "injected" or (
                reason is not None and r.reason is not reason
            ):
                raise self.broken("failures end requests", f"{name} after {event}", name)


def _guarding(edge: Edge) -> str:
    """``'event' (guard, ...)``: an edge's event and guards, as a report names them."""
    return f"{str(edge.event)!r} ({', '.join((*edge.conditions, *edge.unless))})"
