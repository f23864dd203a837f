"""Firing events: the one shared machine per table, batches, the state index, guards and hooks.

Theory of operation
-------------------
A :class:`Lifecycle` tracks the live requests of one owner (a scheduler, a decode peer, a
shop) on one :class:`~lifecycle.table.LifecycleTable`. It keeps, for every live state, an
insertion-ordered collection of the requests in it (the scheduler's queues *are* these
collections), and counts of the requests that ended, by final state and reason. A request that
reaches a final state leaves the index, so nothing accumulates.

There are two ways to fire an event, and both go through the same three steps:

1. **check** — the edge exists for the request's state (for a batch: every request is in that
   state, tracked by this lifecycle, and appears once), then every guard of the edge is
   evaluated once per request. A refusal raises before anything changed:
   :class:`~lifecycle.errors.IllegalTransition` naming the request, its state and the event,
   or :class:`~lifecycle.errors.GuardFailed` naming each guard that refused (from that one
   evaluation; a guard is never evaluated again to word the message).
2. **move** — every request of the batch moves: its state, the index, its timeline, and, on
   entering a final state, its reason, detail and the finished counters.
3. **hooks** — then each request's hooks run in table order (the edge's ``after`` hooks, then
   the destination's ``on_enter`` hooks), every one of them for every request, even when an
   earlier one raised. If any raised, :class:`~lifecycle.errors.HookFailed` is raised at the
   end listing them. So a raising hook never splits a batch: all of it moved and every hook
   was called once, on both paths.

The two paths:

* ``req.<event>()`` (or ``req.fire(event)``) — one request. After the checks, the state is
  set by the table's one shared ``transitions.Machine`` (``model=None``,
  ``auto_transitions=False``; no ``add_model``: that costs O(n) and kilobytes per request):
  the edge's own ``transitions.Transition`` is executed for the request, then the rest of
  step 2 and step 3 are the batch path's. The transition is executed directly rather than
  through ``Event.trigger``, which would look up again the source state and the transition
  the check already found; the machine has no callbacks of its own, so nothing of the
  library's runs between its setting the state and the lifecycle's move, and the table's
  transition skips the library's logging and empty callback loops until something is added
  (:mod:`lifecycle.steps`; docs/benchmarks.md has the figures).
* :meth:`Lifecycle.fire` — one event for a batch of requests that share a state. The edge is
  looked up once for the batch, the clock read once, and the batch shares one timeline entry
  (a tuple). A batch that is the whole of its state's bucket, in the bucket's order (as a
  forward batch whose requests all finish their prompts is), is checked by one list comparison
  against the bucket and moves as a bucket (:mod:`lifecycle.index`). This is the scheduler's
  path and is several times cheaper per request than firing one by one.

Each edge is held as a :class:`~lifecycle.steps.Step`, built once per lifecycle: the edge, its
guards and hooks, the index buckets it moves between, its ``Firing`` for an event without a
reason, and the shared machine's objects for it.

Guards are methods of the record and hooks are callables of the owner, each called as
``f(req)`` or ``f(req, event)`` according to its signature (:mod:`lifecycle.binding`); the
record class is checked against the table's guards when it is bound or first admitted, so a
misspelt guard fails before anything fires.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic

from transitions.core import EventData

from lifecycle.binding import Firing, hook_takes_event
from lifecycle.errors import GuardFailed, HookFailed, IllegalTransition, LifecycleError, MissingHook
from lifecycle.index import check_filing, move_batch, whole_bucket
from lifecycle.record import ADMITTED
from lifecycle.steps import Hook, R, Step, refusal_text, run_hooks, shared_machine
from lifecycle.table import LifecycleTable, guard_methods


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
        missing = sorted(table.hooks() - given.keys())
        if missing:
            raise MissingHook(f"{table.name}: the table names hooks not supplied: {missing}")
        unknown = sorted(given.keys() - table.hooks())
        if unknown:
            raise MissingHook(
                f"{table.name}: hooks supplied that the table does not name: {unknown}"
            )
        takes = {name: hook_takes_event(table.name, name, fn) for name, fn in given.items()}
        self.table = table
        self.clock = clock
        self.check = check
        self._machine = shared_machine(table)
        self._index: dict[enum.IntEnum, dict[str, R]] = {s: {} for s in table.live_states()}
        self._by_rid: dict[str, R] = {}
        self._initial = table.initial
        self._admitted = self._index[table.initial]
        self.finished: collections.Counter[tuple[enum.IntEnum, enum.Enum | None]] = (
            collections.Counter()
        )
        self.transitions_fired = 0
        #: How many guard evaluations firing has made (the fuzzer checks there is one per
        #: guard per request fired at, refusal or not).
        self.guards_evaluated = 0
        # One step per edge: everything firing it needs, looked up once here.
        self._steps: dict[tuple[enum.IntEnum, str], Step[R]] = {
            (e.source, e.event): Step(
                e, self._machine, self._index[e.source], self._index.get(e.dest),
                tuple((h, given[h], takes[h]) for h in table.hooks_of(e)),
            )
            for e in table.edges
        }
        # Per record class: per guard, whether it takes the event argument.
        self._guard_forms: dict[type, dict[str, bool]] = {}
        for cls in (table.record, record):
            if cls is not None and cls not in self._guard_forms:
                self._bind(cls)

    def _bind(self, record: type) -> None:
        forms = self._guard_forms[record] = guard_methods(self.table, record)
        for step in self._steps.values():
            step.bind(record, forms)

    # -- queries ----------------------------------------------------------------------------

    def in_state(self, state: enum.IntEnum) -> Mapping[str, R]:
        """The live requests in ``state``, oldest first (read-only view)."""
        return self._index[state]

    def get(self, rid: str) -> R | None:
        return self._by_rid.get(rid)

    def __len__(self) -> int:
        return len(self._by_rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def counts(self) -> dict[enum.IntEnum, int]:
        return {s: len(b) for s, b in self._index.items()}

    def live(self) -> Iterable[R]:
        return self._by_rid.values()

    def refusal(
        self, req: R, event: str, *, reason: enum.Enum | None = None, detail: str = ""
    ) -> str:
        """Why firing ``event`` at ``req`` now would be refused; ``""`` if it would fire. Each
        guard of the edge is evaluated once."""
        if req.owner is not self:
            return f"request {req.rid!r} is not tracked by this lifecycle"
        assert req.state is not None
        step = self._steps.get((req.state, event))
        if step is None:
            return self._no_edge(req.state, event)
        return self._refusal(step, req, self._firing(step, reason, detail))

    # -- admission --------------------------------------------------------------------------

    def admit(self, req: R) -> None:
        """Start tracking ``req`` in the table's initial state."""
        if req.owner is not None:
            raise LifecycleError(f"request {req.rid!r} is already tracked")
        if req.rid in self._by_rid:
            raise LifecycleError(f"request id {req.rid!r} is already live")
        if type(req) not in self._guard_forms:
            self._bind(type(req))
        req.owner = self
        req.state = self._initial
        req.timeline.append((self.clock(), ADMITTED))
        self._admitted[req.rid] = req
        self._by_rid[req.rid] = req

    # -- firing -----------------------------------------------------------------------------

    def trigger(
        self, req: R, event: str, *, reason: enum.Enum | None = None, detail: str = ""
    ) -> None:
        """Fire ``event`` for one request through the shared transitions machine."""
        if req.owner is not self:
            raise LifecycleError(f"request {req.rid!r} belongs to another lifecycle")
        state = req.state
        assert state is not None
        step = self._steps.get((state, event))
        if step is None:
            raise IllegalTransition(req.rid, state, event, self._no_edge(state, event))
        firing = step.firing if reason is None and not detail else self._firing(
            step, reason, detail
        )
        if step.guards:
            why = self._refusal(step, req, firing)
            if why:
                raise GuardFailed(req.rid, state, event, why)
        # The library's own transition for this edge sets the state (Event.trigger would look
        # up again what the step holds); then the rest of the move, as on the batch path.
        step.transition.execute(
            EventData(step.machine_source, step.machine_event, self._machine, req, (),
                      {"firing": firing})
        )
        self._move([req], step, firing, False)

    def fire(
        self,
        event: str,
        reqs: Sequence[R],
        *,
        reason: enum.Enum | None = None,
        detail: str = "",
    ) -> None:
        """Fire ``event`` for a batch of requests that share a state: all are checked, then all
        move, then the hooks run (see the module docstring for a hook that raises)."""
        if not reqs:
            return
        first = reqs[0]
        src = first.state
        if src is None:
            raise LifecycleError(f"request {first.rid!r} was never admitted to a lifecycle")
        step = self._steps.get((src, event))
        if step is None:
            raise IllegalTransition(first.rid, src, event, self._no_edge(src, event))
        firing = step.firing if reason is None and not detail else self._firing(
            step, reason, detail
        )
        # The batch is legal when it is what the index files under ``src``, each once: a whole
        # bucket in its order (one list comparison), or else one pass over the batch: all in
        # ``src``, all ours, none twice (live requests of one lifecycle have distinct ids). A
        # second pass names the culprit, on a refusal only.
        whole = whole_bucket(step.src_bucket, reqs)
        if not whole and len({r.rid for r in reqs if r.state is src and r.owner is self}) != len(
            reqs
        ):
            self._refuse_batch(reqs, src, event)
        if step.guards:
            self._check_guards(step, reqs, firing)
        self._move(reqs, step, firing, whole)

    def fail(
        self,
        reqs: Iterable[R],
        reason: enum.Enum | None,
        detail: str = "",
        *,
        event: str | None = None,
    ) -> None:
        """Fire a failure event (default: the table's first) for requests in any live states,
        grouped by state."""
        if event is None:
            if not self.table.failure_events:
                raise LifecycleError(f"{self.table.name}: the table declares no failure event")
            event = self.table.failure_events[0]
        groups: dict[enum.IntEnum, list[R]] = {}
        for r in reqs:
            assert r.state is not None
            groups.setdefault(r.state, []).append(r)
        for group in groups.values():
            self.fire(event, group, reason=reason, detail=detail)

    # -- the steps --------------------------------------------------------------------------

    def _no_edge(self, state: enum.IntEnum, event: str) -> str:
        if event not in self.table.events:
            known = ", ".join(str(e) for e in self.table.events)
            return f"table {self.table.name!r} has no such event (its events: {known})"
        return f"{state.name} has no {event!r} edge"

    def _firing(self, step: Step[R], reason: enum.Enum | None, detail: str) -> Firing:
        edge = step.edge
        if (reason is not None or detail) and not step.final:
            raise LifecycleError(
                f"event {str(edge.event)!r} leads to {edge.dest.name}, not a final state: a "
                f"reason or detail goes only with an event that ends a request"
            )
        reasons = self.table.reasons
        if reason is not None and reasons is not None and not isinstance(reason, reasons):
            raise LifecycleError(
                f"{self.table.name}: reason {reason!r} is not a {reasons.__name__}"
            )
        return Firing(edge.event, edge.source, edge.dest, reason, detail)

    def _refuse_batch(self, reqs: Sequence[R], src: enum.IntEnum, event: str) -> None:
        """Raise for the first request of a batch that cannot fire (as the check found)."""
        for r in reqs:
            if r.state is not src:
                raise IllegalTransition(
                    r.rid, r.state or src, event, f"the batch is in state {src.name}"
                )
            if r.owner is not self:
                raise LifecycleError(f"request {r.rid!r} belongs to another lifecycle")
        raise LifecycleError(f"event {str(event)!r}: a request appears twice in the batch")

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
        if len(step.guards) != 1:
            for r in reqs:
                why = self._refusal(step, r, firing)
                if why:
                    raise GuardFailed(r.rid, edge.source, edge.event, why)
            return
        # One guard (every guard of the prefill table): the loop without the string building,
        # the guard looked up again only when the record class changes.
        calls, kind, evaluated = step.guard_calls, None, 0
        try:
            for r in reqs:
                if type(r) is not kind:
                    kind = type(r)
                    ((name, guard, takes_event, wanted),) = calls[kind]
                evaluated += 1
                # ``not`` gives the guard's answer as a bool without calling bool().
                if (not (guard(r, firing) if takes_event else guard(r))) is wanted:
                    raise GuardFailed(r.rid, edge.source, edge.event, refusal_text(name, wanted))
        finally:
            self.guards_evaluated += evaluated

    def _move(self, reqs: Sequence[R], step: Step[R], firing: Firing, whole: bool) -> None:
        """Move a checked batch (``whole``: it is its source bucket, in order) and run the
        hooks."""
        dst = step.edge.dest
        # One timeline entry for the batch: a tuple, so every request may share it.
        entry = (self.clock(), step.edge.event)
        move_batch(reqs, step.src_bucket, step.dst_bucket, self._by_rid, dst, entry, whole)
        if step.final:
            self._ended(reqs, dst, firing)
        self.transitions_fired += len(reqs)
        errors = run_hooks(reqs, step.hooks, firing) if step.hooks else []
        if self.check:
            self.check_index()
        if errors:
            raise HookFailed(step.edge.event, dst, errors) from errors[0][2]

    def _ended(self, reqs: Sequence[R], dst: enum.IntEnum, firing: Firing) -> None:
        """How a batch that entered the final ``dst`` ended: its reason and detail, counted."""
        reason, detail = firing.reason, firing.detail
        if detail:
            for r in reqs:
                r.detail = detail
        if reason is not None:
            for r in reqs:
                r.reason = reason
            self.finished[(dst, reason)] += len(reqs)
        elif len(reqs) == 1:  # the one-request path
            self.finished[(dst, reqs[0].reason)] += 1
        else:  # each ends with the reason it holds, most often None: those are counted in C
            held = [r.reason for r in reqs]
            unset = held.count(None)
            if unset:
                self.finished[(dst, None)] += unset
            if unset != len(held):
                for kept, n in collections.Counter(x for x in held if x is not None).items():
                    self.finished[(dst, kept)] += n

    # -- invariants -------------------------------------------------------------------------

    def check_index(self) -> None:
        """Invariant 4: the per-state collections are exactly the live requests by state."""
        check_filing(self._index, self._by_rid)
