"""Firing events: the one shared machine per table, batches, the state index, guards and hooks.

Theory of operation
-------------------
A :class:`Lifecycle` tracks the live requests of one owner (a scheduler, a decode peer, a
shop) on one :class:`~lifecycle.table.LifecycleTable`. It keeps, for every live state, an
insertion-ordered collection of the requests in it (the scheduler's queues *are* these
collections), and counts of the requests that ended, by final state and reason. A request that
reaches a final state leaves the index, so nothing accumulates.

There are two ways to fire an event, and both go through the same three steps:

1. **check** — the edge exists for the request's state, the request is the record the index
   files under its id in that state (not a copy of it, nor one whose state was assigned by
   hand: one dict lookup), for a batch every request is in that state and appears once, and
   every guard of the edge is evaluated once per request (after all the checks, or, for a
   batch claimed request by request, right after that request's). A refusal raises with
   nothing changed: :class:`~lifecycle.errors.IllegalTransition` naming the request, its
   state and the event, or :class:`~lifecycle.errors.GuardFailed` naming each guard that
   refused (from that one evaluation; a guard is never evaluated again to word the message).
2. **move** — every request of the batch moves: its state, the index, its timeline, and, on
   entering a final state, its reason, detail and the finished counters.
3. **hooks** — then each request's hooks run in table order (the edge's ``after`` hooks, then
   the destination's ``on_enter`` hooks), every one of them for every request, even when an
   earlier one raised. If any raised, :class:`~lifecycle.errors.HookFailed` is raised at the
   end listing them (or, if one raised a ``BaseException`` that is not an ``Exception``, such
   as ``KeyboardInterrupt``, that one, with a note). So a raising hook never splits a batch:
   all of it moved and every hook was called once, on both paths. While a call runs its hooks,
   an event fired at one of its requests (by a hook) is refused with
   :class:`~lifecycle.errors.LifecycleError`, changing nothing: a request's hooks always run
   to the end for the state it entered, and a state's hooks never run after the request left
   it. Events a hook fires at other requests fire as usual, their hooks run inside the hook.

The two paths:

* ``req.<event>()`` (or ``req.fire(event)``) — one request. After the checks, the state is
  set by the table's one shared ``transitions.Machine`` (``model=None``,
  ``auto_transitions=False``; no ``add_model``: that costs O(n) and kilobytes per request):
  the edge's own ``transitions.Transition`` is executed for the request, then the rest of
  step 2 and step 3 are the batch path's. Executing it directly skips ``Event.trigger``'s
  second look-up of what the check found; the machine is sealed (it takes no callbacks, so
  both paths run the table's hooks and nothing else), and the table's transition skips the
  library's logging and empty callback loops while its logger is quiet (:mod:`lifecycle.steps`;
  docs/benchmarks.md has the figures).
* :meth:`Lifecycle.fire` — one event for a batch of requests that share a state. The edge is
  looked up once for the batch, the clock read once, and the batch shares one timeline entry
  (a tuple). A batch that is the whole of its state's bucket, in the bucket's order, is checked
  by one pass comparing identities and moves as a bucket; part of a bucket is checked and moved
  request by request, each request claimed as it is checked (a refusal undoes the claims before
  raising); :mod:`lifecycle.index` has both. Records are matched by identity throughout, never
  by ``==`` (a record class may compare its fields). This is the scheduler's path and is
  several times cheaper per request than firing one by one.

Each edge is a :class:`~lifecycle.steps.Step`, built once per lifecycle with all firing needs.

Guards are methods of the record and hooks are callables of the owner, each called as
``f(req)`` or ``f(req, event)`` according to its signature (:mod:`lifecycle.binding`); the
record class is checked against the table's guards when it is bound or first admitted, so a
misspelt guard fails before anything fires. A lifecycle told no record class (neither its
table nor it was given ``record=``) refuses a record of a class another table was built for:
it would run this table's guards and hooks on it. Those checks are made once per record class
(``admit`` compares the class with the last one admitted, and binds a new one once).
"""

from __future__ import annotations

import collections
import enum
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic

from transitions.core import EventData

from lifecycle.binding import Firing, hooks_take_event
from lifecycle.errors import GuardFailed, IllegalTransition, LifecycleError
from lifecycle.index import check_filing, claim, leave, move_batch, unclaim, whole_bucket
from lifecycle.record import ADMITTED, Tracked
from lifecycle.steps import (
    GuardCall,
    Hook,
    R,
    Step,
    count_ended,
    hooks_raised,
    refusal_text,
    run_hooks,
    shared_machine,
)
from lifecycle.table import LifecycleTable, bind_record, tables_for


class Lifecycle(Generic[R]):
    """The live requests of one owner on one table, and the way their events are fired."""

    def __init__(
        self,
        table: LifecycleTable,
        hooks: Mapping[str, Hook] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        check: bool = False,
        record: type[R] | None = None,
    ) -> None:
        """``hooks`` by name, each ``hook(req)`` or ``hook(req, event)``; ``record``, the record
        class, to check the table's guards against now rather than at the first admission (a
        table built with ``record=`` is checked already)."""
        given = dict(hooks or {})
        takes = hooks_take_event(table.name, table.hooks(), given)
        self.table = table
        self.clock = clock
        self.check = check
        self._machine = shared_machine(table)
        self._index: dict[enum.IntEnum, dict[str, R]] = {s: {} for s in table.live_states()}
        # What in_state hands out: a read-only view of each bucket, made once (no copy).
        self._views: dict[enum.IntEnum, Mapping[str, R]] = {
            s: types.MappingProxyType(b) for s, b in self._index.items()
        }
        self._by_rid: dict[str, R] = {}
        self._initial = table.initial
        self._admitted = self._index[table.initial]
        self.finished: collections.Counter[tuple[enum.IntEnum, enum.Enum | None]] = (
            collections.Counter()
        )
        #: How many guard evaluations firing has made (the fuzzer checks there is one per
        #: guard per request fired at, refusal or not).
        self.guards_evaluated = 0
        # The calls running their hooks now, innermost first (a hook may fire at other
        # requests): an event fired at one of their requests is refused until they return.
        self._hooking: _Running | None = None
        # One step per edge: everything firing it needs, looked up once here.
        failure_states = table.failure_states()
        self._steps: dict[tuple[enum.IntEnum, str], Step[R]] = {
            (e.source, e.event): Step(
                e,
                self._machine,
                self._index[e.source],
                self._index.get(e.dest),
                tuple((h, given[h], takes[h]) for h in table.hooks_of(e)),
                failure=e.dest in failure_states,
            )
            for e in table.edges
        }
        # Per record class: per guard, whether it takes the event argument.
        self._guard_forms: dict[type, dict[str, bool]] = {}
        # The record class admitted last, and whether another was ever admitted: while only one
        # was, every live request is of it, and a batch's guard is looked up once.
        self._kind: type | None = None
        self._mixed = False
        # The record classes this lifecycle is for, when the table or the caller says.
        self._declared = (table.record, record)
        for cls in self._declared:
            if cls is not None and cls not in self._guard_forms:
                self._bind(cls)

    def __reduce__(self) -> Any:
        raise LifecycleError(
            f"a Lifecycle ({self.table.name}) cannot be pickled or copied: it is the live "
            f"requests of one owner, with their hooks; pickle or copy a record once it has "
            f"ended (it keeps only its table), or the fields you need of a live one")

    def __deepcopy__(self, memo: dict[int, Any]) -> Lifecycle[R]:
        return self  # a deep copy of a live record keeps its owner, as a copy does

    def _bind(self, record: type) -> None:
        forms = self._guard_forms[record] = bind_record(self.table, record)
        for step in self._steps.values():
            step.bind(record, forms)

    # -- queries ----------------------------------------------------------------------------

    def in_state(self, state: enum.IntEnum) -> Mapping[str, R]:
        """The live requests in ``state``, oldest first: a read-only view of the lifecycle's own
        collection (it follows later events; copy it, ``list(...values())``, to keep a
        snapshot)."""
        try:
            return self._views[state]
        except KeyError:
            raise self._not_live(state) from None

    def _not_live(self, state: object) -> LifecycleError:
        table = self.table
        if isinstance(state, table.states) and state in table.finals:
            return LifecycleError(
                f"{table.name}: {state.name} is a final state, and the lifecycle keeps only "
                f"live requests; ended ones are counted in .finished by (state, reason)")
        return LifecycleError(
            f"{table.name}: {state!r} is not a state of {table.states.__name__}")

    def get(self, rid: str) -> R | None:
        return self._by_rid.get(rid)

    def __len__(self) -> int:
        return len(self._by_rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def counts(self) -> dict[enum.IntEnum, int]:
        return {s: len(b) for s, b in self._index.items()}

    @property
    def transitions_fired(self) -> int:
        """Requests moved by an event since the lifecycle was made (one per request of a batch)."""
        return sum(step.fired for step in self._steps.values())

    def fired_by_event(self) -> dict[str, int]:
        """:attr:`transitions_fired` by event (every event of the table, 0 if never fired).
        Each edge counts for itself as it fires; this sums them, so a reader (a metrics
        scrape) costs the firing nothing."""
        out = dict.fromkeys((str(e) for e in self.table.events), 0)
        for (_, event), step in self._steps.items():
            out[str(event)] += step.fired
        return out

    def live(self) -> Iterable[R]:
        return self._by_rid.values()

    def refusal(
        self, req: R, event: str, *, reason: enum.Enum | None = None, detail: str = ""
    ) -> str:
        """Why firing ``event`` at ``req`` now would be refused; ``""`` if it would fire. Each
        guard of the edge is evaluated once. An event the table does not have is not a refusal
        but a mistake in the caller (a filter on it would drop every request): it raises
        :class:`IllegalTransition`, as firing it does."""
        if req.owner is not self:
            return f"request {req.rid!r} is not tracked by this lifecycle"
        assert req.state is not None
        step = self._steps.get((req.state, event))
        if step is None:
            if event not in self.table.events:
                raise IllegalTransition(
                    req.rid, req.state, event, self.table.no_edge(req.state, event))
            refused = self._no_step(req, req.state, event)
            return refused.why if isinstance(refused, IllegalTransition) else str(refused)
        if step.src_bucket.get(req.rid) is not req:
            return str(self._misfiled(req))
        try:
            firing = step.fired_with(reason, detail, self.table)
        except LifecycleError as exc:  # the reason or detail does not fit the edge
            return str(exc)
        return self._refusal(step, req, firing)

    # -- admission --------------------------------------------------------------------------

    def admit(self, req: R) -> None:
        """Start tracking ``req`` in the table's initial state; its timeline starts with the
        admission, in a list no other admitted record holds (one it was built with that holds
        entries is left as it was, not emptied: a record made by ``attrs.evolve`` shares its
        original's). A record is admitted once: one
        that is tracked, or that ended, is refused (a new attempt is a new record), and so is
        one built in another state than the initial one, or with a reason or detail (they say
        how a request ended, and only the event that ends it sets them)."""
        if type(req) is not self._kind:
            self._admit_kind(req)
        rid = req.rid
        if req.owner is not None:
            raise self._admitted_before(req)
        state = req.state
        if (state is not None and state is not self._initial) or req.reason is not None or (
                req.detail):
            raise self._built_otherwise(req)
        # ``setdefault`` files the request under its id unless another is: one lookup.
        if self._by_rid.setdefault(rid, req) is not req:
            raise self._admitted_before(req)
        req.owner = self
        req.state = self._initial
        clock = self.clock  # an attribute: ``self.clock()`` would be an unspecialised LOAD_METHOD
        timeline = req.timeline
        if timeline:  # entries of its own, or its original's (attrs.evolve): a list of its own
            req.timeline = [(clock(), ADMITTED)]
        else:  # the list it was built with (an admitted record's is never empty)
            timeline.append((clock(), ADMITTED))
        self._admitted[rid] = req

    def _built_otherwise(self, req: R) -> LifecycleError:
        """Why ``req``, not admitted before, cannot be: it was built in another state than the
        initial one, or with a reason or detail."""
        state = req.state
        if state is not None and state is not self._initial:
            return LifecycleError(
                f"request {req.rid!r} was built in state {state.name}: a record starts in the "
                f"initial state {self._initial.name}, and only firing events moves it; leave "
                f"state out when you build it")
        given = " and ".join(
            [*([f"reason {req.reason!r}"] if req.reason is not None else []),
             *([f"detail {req.detail!r}"] if req.detail else [])])
        return LifecycleError(
            f"request {req.rid!r} was built with {given}: a reason and a detail say how a "
            f"request ended, and only the event that ends it sets them; leave them out when "
            f"you build it")

    def _admitted_before(self, req: R) -> LifecycleError:
        """Why ``req`` cannot be admitted: it is tracked, it ended, or its id is live."""
        rid = req.rid
        owner = req.owner
        if owner is None:
            return LifecycleError(f"request id {rid!r} is already live")
        if req.is_final:
            assert req.state is not None
            return LifecycleError(
                f"request {rid!r} ended in {req.state.name}: a record is admitted once; admit a "
                f"new record to track the request again"
            )
        where = "this lifecycle" if owner is self else "another lifecycle"
        return LifecycleError(f"request {rid!r} is already tracked by {where}")

    def _admit_kind(self, req: R) -> None:
        kind = type(req)
        if kind not in self._guard_forms:
            self._check_kind(req)
            self._bind(kind)
        self._mixed = self._mixed or self._kind is not None
        self._kind = kind

    def _check_kind(self, req: object) -> None:
        """Refuse, before its guards are looked up on it, a record of a class this lifecycle
        is not for: not a :class:`Tracked`; not of the class the table was built with
        (``record=``) or the lifecycle was given; or, when neither names one, of a class
        another table was built with (its guards and hooks are that table's: sharing a class
        is said with ``record=``). Called once per record class (``admit`` caches it)."""
        table = self.table
        kind = type(req)
        if not isinstance(req, Tracked):
            raise TypeError(
                f"{table.name}: admit() takes a record, an instance of a subclass of "
                f"lifecycle.Tracked, got {kind.__name__}")
        declared = [c for c in self._declared if c is not None]
        if declared and not isinstance(req, tuple(declared)):
            names = " or ".join(c.__name__ for c in dict.fromkeys(declared))
            raise TypeError(
                f"{table.name}: request {req.rid!r} is of class {kind.__name__}, and this "
                f"lifecycle tracks records of class {names} (the table's or the lifecycle's "
                f"record=) or its subclasses; records of class {kind.__name__} need a "
                f"lifecycle of their own")
        others = tables_for(kind) if not declared else []
        if others:
            theirs = " and ".join(
                f"{'another table named' if t.name == table.name else 'table'} {t.name!r} "
                f"(record={getattr(t.record, '__name__', None)})" for t in others)
            raise TypeError(
                f"{table.name}: request {req.rid!r} is of class {kind.__name__}, which "
                f"{theirs} was built for, and neither this lifecycle nor its table "
                f"{table.name!r} names a record class, so its guards and hooks would be this "
                f"table's: admit it to a lifecycle of the table it was built for, or, to track "
                f"{kind.__name__} records by table {table.name!r} too, pass "
                f"record={kind.__name__} to this Lifecycle or to its table's make_table")

    # -- firing -----------------------------------------------------------------------------

    def trigger(
        self, req: R, event: str, *, reason: enum.Enum | None = None, detail: str = ""
    ) -> None:
        """Fire ``event`` for one request through the shared transitions machine."""
        if req.owner is not self:
            raise LifecycleError(f"request {req.rid!r} belongs to another lifecycle")
        if self._hooking is not None:
            self._refuse_reentry((req,), event)
        state = req.state
        assert state is not None
        step = self._steps.get((state, event))
        if step is None:
            raise self._no_step(req, state, event)
        if step.src_bucket.get(req.rid) is not req:  # a copy, or a state assigned by hand
            raise self._misfiled(req)
        firing = (
            step.firing
            if reason is None and detail == ""  # not ``not detail``: 0 or None is refused
            else step.fired_with(reason, detail, self.table)
        )
        if step.guards:
            why = self._refusal(step, req, firing)
            if why:
                raise GuardFailed(req.rid, state, event, why)
        # The library's own transition for this edge sets the state (Event.trigger would look
        # up again what the step holds); then the rest of the move, as on the batch path.
        step.transition.execute(
            EventData(
                step.machine_source, step.machine_event, self._machine, req, (), {"firing": firing}
            )
        )
        batch = (req,)
        self._move(batch, step, firing, False)
        if step.hooks or self.check:
            self._finish(batch, step, firing)

    def fire(
        self,
        event: str,
        reqs: Iterable[R],
        *,
        reason: enum.Enum | None = None,
        detail: str = "",
    ) -> None:
        """Fire ``event`` for a batch of requests that share a state: all are checked, then all
        move, then the hooks run (see the module docstring for a hook that raises). The batch is
        a list or tuple, or any iterable, read once (a view of the index, ``in_state(s).values()``,
        is copied before anything moves)."""
        # Anything but a list or tuple is read once here: a generator cannot be read twice, and
        # a view of a bucket would change as the batch moves.
        batch: Sequence[R] = reqs if isinstance(reqs, (list, tuple)) else _batch(reqs, "fire")
        if not batch:
            return
        if self._hooking is not None:
            self._refuse_reentry(batch, event)
        first = batch[0]
        src = first.state
        if src is None:
            raise LifecycleError(f"request {first.rid!r} was never admitted to a lifecycle")
        step = self._steps.get((src, event))
        if step is None:
            raise self._no_step(first, src, event)
        firing = (
            step.firing
            if reason is None and detail == ""
            else step.fired_with(reason, detail, self.table)
        )
        self._take(step, batch, firing)
        if step.hooks or self.check:
            self._finish(batch, step, firing)

    def _take(self, step: Step[R], batch: Sequence[R], firing: Firing) -> None:
        """Check ``batch`` (not empty) for ``step`` and move it (no hooks yet), or raise with
        nothing changed."""
        src, event = step.edge.source, step.edge.event
        # The batch is legal when it is what the index files under ``src``, each once: a whole
        # bucket in its order (one pass comparing identities), or else each request in ``src``,
        # ours, and not twice (live requests of one lifecycle have distinct ids): claimed one by one
        # (lifecycle.index), or, on a self-loop or with guards a claim does not evaluate, one
        # pass over the batch. A second pass names the culprit, on a refusal only.
        if whole_bucket(step.src_bucket, batch):
            if step.guards:
                self._check_guards(step, batch, firing)
            self._move(batch, step, firing, True)
            return
        guard = self._single_guard(step) if step.guards else None
        if step.dst_bucket is not step.src_bucket and (guard is not None or not step.guards):
            self._claim(step, batch, firing, guard)
            return
        filed = step.src_bucket.get
        if len({r.rid for r in batch if r.state is src and filed(r.rid) is r}) != len(batch):
            self._check_batch(batch, src, event)
        if step.guards:
            self._check_guards(step, batch, firing)
        self._move(batch, step, firing, False)

    def fail(
        self,
        reqs: Iterable[R],
        reason: enum.Enum | None,
        detail: str = "",
        *,
        event: str | None = None,
    ) -> None:
        """Fire a failure event (default: the table's first) for requests in any live states,
        grouped by state. All or none: every request is checked first (live, tracked by this
        lifecycle, present once; the reason and detail fit), and only then does any move. A
        failure event is unguarded and legal from every live state, so nothing after the checks
        can refuse. Every group moves before any hook runs, and the hooks of all of them run
        then as one batch's do (an event a hook fires at a request of the call is refused); a
        hook that raises is reported once every hook ran (``HookFailed``)."""
        failure_events = self.table.failure_events
        if event is None:
            if not failure_events:
                raise LifecycleError(f"{self.table.name}: the table declares no failure event")
            event = failure_events[0]
        elif event not in failure_events:
            known = ", ".join(str(e) for e in failure_events) or "none"
            raise LifecycleError(
                f"fail(): event {str(event)!r} is not a failure event of table "
                f"{self.table.name!r} (its failure events: {known}); fire it with fire()"
            )
        batch: Sequence[R] = reqs if isinstance(reqs, (list, tuple)) else _batch(reqs, "fail")
        if self._hooking is not None:
            self._refuse_reentry(batch, event)
        groups: dict[enum.IntEnum, tuple[Step[R], Firing, list[R]]] = {}
        for r in batch:
            state = r.state
            if state is None:
                raise LifecycleError(f"request {r.rid!r} was never admitted to a lifecycle")
            if r.owner is not self:
                raise LifecycleError(f"request {r.rid!r} belongs to another lifecycle")
            step = self._steps.get((state, event))
            if step is None:  # it ended: a failure event is legal from every live state
                raise IllegalTransition(r.rid, state, event, self.table.no_edge(state, event))
            if step.src_bucket.get(r.rid) is not r:
                raise self._misfiled(r)
            group = groups.get(state)
            if group is None:
                # Refuses a misfit reason or detail.
                group = groups[state] = (step, step.fired_with(reason, detail, self.table), [])
            group[2].append(r)
        if len({id(r) for r in batch}) != len(batch):
            raise LifecycleError(f"event {str(event)!r}: a request appears twice in the batch")
        # Every group moves before any hook runs, as one batch does: a failure event is legal
        # and unguarded from every live state, so nothing can refuse a group once checked; and
        # while the hooks run, an event a hook fires at any request of the call is refused.
        for step, firing, members in groups.values():
            self._take(step, members, firing)
        errors: list[tuple[str, str, BaseException]] = []
        dest: enum.IntEnum | None = None
        outer = self._hooking
        self._hooking = _Running(batch, event, outer)
        try:
            for step, firing, members in groups.values():
                if step.hooks:
                    raised = run_hooks(members, step.hooks, firing)
                    if raised and dest is None:
                        dest = step.edge.dest
                    errors += raised
        finally:
            self._hooking = outer
        if self.check:
            self.check_index()
        if errors:
            assert dest is not None
            raise hooks_raised(event, dest, errors)

    # -- the steps --------------------------------------------------------------------------

    def _check_batch(self, reqs: Sequence[R], src: enum.IntEnum, event: str) -> None:
        """Raise for the first request of a batch that cannot fire from ``src`` (not in it, not
        ours, not the record filed under its id), or because a request appears twice; return if
        the batch may fire."""
        bucket = self._index[src]
        for r in reqs:
            state = r.state
            if state is None:  # as when it is fired alone
                raise LifecycleError(f"request {r.rid!r} was never admitted to a lifecycle")
            if state is not src:
                raise IllegalTransition(r.rid, state, event, f"the batch is in state {src.name}")
            if r.owner is not self:
                raise LifecycleError(f"request {r.rid!r} belongs to another lifecycle")
            if bucket.get(r.rid) is not r:
                raise self._misfiled(r)
        if len({id(r) for r in reqs}) != len(reqs):
            raise LifecycleError(f"event {str(event)!r}: a request appears twice in the batch")

    def _no_step(self, req: R, state: enum.IntEnum, event: str) -> LifecycleError:
        """Why ``event`` cannot fire at ``req``, whose state ``state`` has no such edge: the
        record is not the one filed in that state (a copy, or a state assigned by hand), or,
        when it is, the table has no such edge (:class:`IllegalTransition`)."""
        if self._by_rid.get(req.rid) is req:  # live: it must be filed in the state it says
            misfiled = self._index.get(state, {}).get(req.rid) is not req
        else:  # ended: only a final state is its own
            misfiled = state not in self.table.finals
        if misfiled:
            return self._misfiled(req)
        return IllegalTransition(req.rid, state, event, self.table.no_edge(state, event))

    def _misfiled(self, req: R) -> LifecycleError:
        """Why ``req`` is not the record this lifecycle files under its id in its state: another
        lifecycle's, a copy of a tracked record, or one whose state was assigned by hand."""
        rid = req.rid
        if req.owner is not self:
            return LifecycleError(f"request {rid!r} belongs to another lifecycle")
        state = req.state.name if req.state is not None else "None"
        filed = self._by_rid.get(rid)
        if filed is req:
            where = next(s.name for s, b in self._index.items() if b.get(rid) is req)
            return LifecycleError(
                f"request {rid!r} is filed under {where} but its state says {state}: its state "
                f"was assigned by hand; only firing an event may change a tracked record's state"
            )
        if filed is not None:
            return LifecycleError(
                f"request {rid!r} is a copy of a tracked record (copy.copy, attrs.evolve): "
                f"this lifecycle tracks another object under that id, and a copy cannot fire; "
                f"fire the record that was admitted"
            )
        return LifecycleError(
            f"request {rid!r} says {state}, but it is not live in this lifecycle (it ended): it "
            f"is a copy of a tracked record, or its state was assigned by hand; neither can fire"
        )

    def _single_guard(self, step: Step[R]) -> GuardCall | None:
        """The edge's guard as every live request calls it, when the edge has one guard, it
        takes no event, and this lifecycle admitted one record class only; else None."""
        if len(step.guards) != 1 or self._mixed or self._kind is None:
            return None
        ((call),) = step.guard_calls[self._kind]
        return None if call[2] else call

    def _claim(
        self, step: Step[R], reqs: Sequence[R], firing: Firing, guard: GuardCall | None
    ) -> None:
        """Check and move a batch that is part of its source bucket, request by request (see
        lifecycle.index); on a refusal, undo the claims and raise as the checks would."""
        edge = step.edge
        src, dst, bucket = edge.source, edge.dest, step.dst_bucket
        entry = (self.clock(), edge.event)
        fn, wanted = (guard[1], guard[3]) if guard is not None else (None, True)
        try:
            refused = claim(reqs, step.src_bucket, src, dst, bucket, entry, fn, wanted)
        except BaseException:  # the guard raised: undo, and count its evaluations
            undone = unclaim(reqs, src, dst, bucket, entry)
            if guard is not None:
                self.guards_evaluated += undone + 1
            raise
        if refused is not None:
            claimed = unclaim(reqs, src, dst, bucket, entry)
            if guard is not None:
                self.guards_evaluated += claimed
            self._check_batch(reqs, src, edge.event)  # a batch refused whatever the guard says
            assert guard is not None  # in src, ours, once: so the guard refused it
            self.guards_evaluated += 1
            raise GuardFailed(refused.rid, src, edge.event, refusal_text(guard[0], wanted))
        if guard is not None:
            self.guards_evaluated += len(reqs)
        leave(reqs, step.src_bucket, self._by_rid if step.final else None)
        self._move(reqs, step, firing, None)

    def _refusal(self, step: Step[R], req: R, firing: Firing) -> str:
        refused = ""
        for name, guard, takes_event, wanted in step.guard_calls[type(req)]:
            self.guards_evaluated += 1
            if bool(guard(req, firing) if takes_event else guard(req)) is not wanted:
                refused += f"{'; ' if refused else ''}{refusal_text(name, wanted)}"
        return refused

    def _check_guards(self, step: Step[R], reqs: Sequence[R], firing: Firing) -> None:
        """Evaluate every guard of ``step`` once per request, in batch order; raise
        :class:`GuardFailed` for the first request refused (after all its guards)."""
        edge = step.edge
        call = self._single_guard(step)
        if call is None:
            for r in reqs:
                why = self._refusal(step, r, firing)
                if why:
                    raise GuardFailed(r.rid, edge.source, edge.event, why)
            return
        # One guard without the event, one record class (every guard of the prefill table):
        # the loop without the string building, the lookups or the counting; the batch holds
        # no request twice, so a request's position counts the evaluations up to it.
        name, guard, _, wanted = call
        r = reqs[0]
        try:
            for r in reqs:
                # ``not`` gives the guard's answer as a bool without calling bool().
                if (not guard(r)) is wanted:
                    break
            else:
                self.guards_evaluated += len(reqs)
                return
        except BaseException:  # the guard raised: evaluated up to ``r``
            self.guards_evaluated += _position(reqs, r) + 1
            raise
        self.guards_evaluated += _position(reqs, r) + 1
        raise GuardFailed(r.rid, edge.source, edge.event, refusal_text(name, wanted))

    def _move(self, reqs: Sequence[R], step: Step[R], firing: Firing, whole: bool | None) -> None:
        """Move a checked batch (``whole``: it is its source bucket, in order; None: it was
        claimed, so it moved already), then how it ended and the counters."""
        dst = step.edge.dest
        if whole is not None:
            # One timeline entry for the batch: a tuple, so every request may share it.
            entry = (self.clock(), step.edge.event)
            move_batch(reqs, step.src_bucket, step.dst_bucket, self._by_rid, dst, entry, whole)
        if step.final:
            count_ended(self.finished, reqs, dst, firing)
        step.fired += len(reqs)

    def _finish(self, reqs: Sequence[R], step: Step[R], firing: Firing) -> None:
        """After a batch moved: every hook of every request (an event fired at one of them
        from a hook is refused meanwhile), the index check, and what the hooks raised."""
        errors = None
        if step.hooks:
            outer = self._hooking
            self._hooking = _Running(reqs, step.edge.event, outer)
            try:
                errors = run_hooks(reqs, step.hooks, firing)
            finally:
                self._hooking = outer
        if self.check:
            self.check_index()
        if errors:
            raise hooks_raised(step.edge.event, step.edge.dest, errors)

    def _refuse_reentry(self, reqs: Sequence[R], event: str) -> None:
        """Raise if a request of ``reqs`` belongs to a call still running its hooks (this is a
        hook firing at it); return if none does."""
        running = self._hooking
        while running is not None:
            ids = {id(r) for r in running.reqs}
            for r in reqs:
                if id(r) in ids:
                    state = r.state.name if r.state is not None else "None"
                    raise LifecycleError(
                        f"request {r.rid!r} cannot take event {str(event)!r} from inside a "
                        f"hook: the {str(running.event)!r} that moved it (to {state}) is "
                        f"still running its hooks. Nothing changed; decide it in a guard, or "
                        f"fire it once that call has returned.")
            running = running.outer

    # -- invariants -------------------------------------------------------------------------

    def check_index(self) -> None:
        """Invariant 4: the per-state collections are exactly the live requests by state."""
        check_filing(self._index, self._by_rid)


class _Running:
    """A call running its hooks: its requests and event, and the call it runs in (a hook of
    that one fired it), if any."""

    __slots__ = ("event", "outer", "reqs")

    def __init__(self, reqs: Sequence[Any], event: str, outer: _Running | None) -> None:
        self.reqs = reqs
        self.event = event
        self.outer = outer


def _position(reqs: Sequence[R], req: R) -> int:
    """Where ``req`` is in ``reqs``, by identity (``list.index`` would call a record's
    ``__eq__``)."""
    return next(i for i, r in enumerate(reqs) if r is req)


def _batch(reqs: Iterable[R], method: str) -> list[R]:
    """``reqs`` read once into a list; one request given alone is refused by name (a record
    is not iterable, and saying so would not say what to do)."""
    rid = getattr(reqs, "rid", None)
    if isinstance(rid, str) and hasattr(reqs, "state"):
        raise TypeError(f"{method}() takes a batch of requests, got the one request {rid!r}: "
                        "pass [request]")
    return list(reqs)
