"""Firing events: the one shared machine per table, batches, the state index, hooks.

Theory of operation
-------------------
A :class:`Lifecycle` tracks the live requests of one owner (a scheduler, a decode peer) on one
:class:`~lifecycle.table.LifecycleTable`. It keeps, for every live state, an insertion-ordered
collection of the requests in it (the scheduler's queues *are* these collections), and counts of
the requests that ended, by final state and reason. A request that reaches a final state leaves
the index, so nothing accumulates.

There are two ways to fire an event, and both end in the same bookkeeping
(:meth:`Lifecycle._entered_one`):

* ``req.<event>()`` — the request's trigger method. It goes through the table's one shared
  ``transitions.Machine`` (``model=None``, ``auto_transitions=False``; no ``add_model``: that
  costs O(n) and kilobytes per request), which evaluates the guards and calls back.
* :meth:`Lifecycle.fire` — one event for a batch of requests that share a state. The edge is
  looked up once for the batch, every request is checked (state, owner, guards) *before*
  anything changes, then all move. This is the scheduler's path and is several times cheaper
  per request than firing one by one.

An illegal event raises :class:`~lifecycle.errors.IllegalTransition` naming the request, its
state and the event, and changes nothing (for a batch: changes no request).

Hooks are named in the table and supplied by the owner. Entering a final state runs that
state's ``on_enter`` hooks exactly once, because final states are absorbing: the prefill table
names ``release`` (the owner gives pages, slot and sender back to the KV layer) and ``respond``
there.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from transitions import Machine, MachineError

from lifecycle.errors import GuardFailed, IllegalTransition, LifecycleError, MissingHook
from lifecycle.reasons import FailureReason
from lifecycle.record import Tracked
from lifecycle.table import Edge, LifecycleTable

R = TypeVar("R", bound=Tracked)
Hook = Callable[[R], None]

# id(table) -> (table, machine). Holding the table keeps it alive, so its id cannot be reused
# by a later table (which would otherwise be handed this table's machine).
_MACHINES: dict[int, tuple[LifecycleTable, Machine]] = {}


def shared_machine(table: LifecycleTable) -> Machine:
    """The one ``transitions.Machine`` of ``table`` (built on first use)."""
    entry = _MACHINES.get(id(table))
    if entry is not None:
        return entry[1]
    machine = Machine(
        model=None,
        states=table.states,
        transitions=[
            {
                "trigger": e.event,
                "source": e.source,
                "dest": e.dest,
                "conditions": list(e.conditions),
                "unless": list(e.unless),
            }
            for e in table.edges
        ],
        initial=None,
        auto_transitions=False,
        send_event=True,
        after_state_change="_after_transition",
    )
    _MACHINES[id(table)] = (table, machine)
    return machine


class Lifecycle(Generic[R]):
    """The live requests of one owner on one table, and the way their events are fired."""

    def __init__(
        self,
        table: LifecycleTable,
        hooks: Mapping[str, Hook[R]] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        check: bool = False,
    ) -> None:
        hooks = dict(hooks or {})
        missing = sorted(table.hooks() - hooks.keys())
        if missing:
            raise MissingHook(f"{table.name}: the table names hooks not supplied: {missing}")
        self.table = table
        self.clock = clock
        self.check = check
        self._machine = shared_machine(table)
        self._index: dict[enum.IntEnum, dict[str, R]] = {s: {} for s in table.live_states()}
        self._by_rid: dict[str, R] = {}
        self.finished: collections.Counter[tuple[enum.IntEnum, FailureReason | None]] = (
            collections.Counter()
        )
        self.transitions_fired = 0
        # Hooks resolved once per edge: after-hooks, then the destination's on_enter hooks.
        self._edge_hooks: dict[tuple[enum.IntEnum, str], tuple[Hook[R], ...]] = {
            (e.source, e.event): tuple(
                hooks[h] for h in (*e.after, *table.on_enter.get(e.dest, ()))
            )
            for e in table.edges
        }

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

    # -- admission --------------------------------------------------------------------------

    def admit(self, req: R) -> None:
        """Start tracking ``req`` in the table's initial state."""
        if req.owner is not None:
            raise LifecycleError(f"request {req.rid!r} is already tracked")
        if req.rid in self._by_rid:
            raise LifecycleError(f"request id {req.rid!r} is already live")
        initial = self.table.initial
        req.owner = self
        req.state = initial
        req.timeline.append((self.clock(), ""))
        self._index[initial][req.rid] = req
        self._by_rid[req.rid] = req

    # -- firing -----------------------------------------------------------------------------

    def trigger(
        self, req: R, event: str, *, reason: FailureReason | None = None, detail: str = ""
    ) -> None:
        """Fire ``event`` for one request through the shared transitions machine."""
        if req.owner is not self:
            raise LifecycleError(f"request {req.rid!r} belongs to another lifecycle")
        state = req.state
        assert state is not None
        edge = self.table.edge(state, event)
        if edge is None:
            raise IllegalTransition(req.rid, state, event)
        try:
            moved = self._machine.events[event].trigger(req, reason=reason, detail=detail)
        except MachineError:
            raise IllegalTransition(req.rid, state, event) from None
        if not moved:
            raise GuardFailed(req.rid, state, event, _guard_report(edge, req))

    def fire(
        self,
        event: str,
        reqs: Sequence[R],
        *,
        reason: FailureReason | None = None,
        detail: str = "",
    ) -> None:
        """Fire ``event`` for a batch of requests that share a state, all or none."""
        if not reqs:
            return
        first = reqs[0]
        src = first.state
        assert src is not None
        edge = self.table.lookup.get((src, event))
        if edge is None:
            raise IllegalTransition(first.rid, src, event)
        guards = edge.conditions or edge.unless
        for r in reqs:
            if r.state is not src:
                raise IllegalTransition(
                    r.rid, r.state or src, event, f"the batch is in state {src.name}"
                )
            if r.owner is not self:
                raise LifecycleError(f"request {r.rid!r} belongs to another lifecycle")
            if guards and not _guards_hold(edge, r):
                raise GuardFailed(r.rid, src, event, _guard_report(edge, r))
        if len({id(r) for r in reqs}) != len(reqs):
            raise LifecycleError(f"event {event!r}: a request appears twice in the batch")
        now = self.clock()
        dst = edge.dest
        src_bucket = self._index[src]
        dst_bucket = self._index.get(dst)
        by_rid = self._by_rid
        hooks = self._edge_hooks[(src, event)]
        final = dst_bucket is None
        for r in reqs:
            del src_bucket[r.rid]
            r.state = dst
            r.timeline.append((now, event))
            if final:
                del by_rid[r.rid]
                if reason is not None:
                    r.reason = reason
                    r.detail = detail
                self.finished[(dst, r.reason)] += 1
            else:
                dst_bucket[r.rid] = r  # type: ignore[index]
            for hook in hooks:
                hook(r)
        self.transitions_fired += len(reqs)
        if self.check:
            self.check_index()

    def fail(
        self,
        reqs: Iterable[R],
        reason: FailureReason,
        detail: str = "",
        *,
        event: str = "fail",
    ) -> None:
        """Fire a failure event for requests in any live states (grouped by state)."""
        groups: dict[enum.IntEnum, list[R]] = {}
        for r in reqs:
            assert r.state is not None
            groups.setdefault(r.state, []).append(r)
        for group in groups.values():
            self.fire(event, group, reason=reason, detail=detail)

    def _entered_one(
        self,
        req: R,
        src: enum.IntEnum,
        event: str,
        reason: FailureReason | None,
        detail: str,
    ) -> None:
        # The trigger path's bookkeeping; the batch path inlines the same steps.
        dst = req.state
        assert dst is not None
        del self._index[src][req.rid]
        req.timeline.append((self.clock(), event))
        dst_bucket = self._index.get(dst)
        if dst_bucket is None:
            del self._by_rid[req.rid]
            if reason is not None:
                req.reason = reason
                req.detail = detail
            self.finished[(dst, req.reason)] += 1
        else:
            dst_bucket[req.rid] = req
        for hook in self._edge_hooks[(src, event)]:
            hook(req)
        self.transitions_fired += 1
        if self.check:
            self.check_index()

    # -- invariants -------------------------------------------------------------------------

    def check_index(self) -> None:
        """Invariant 4: the per-state collections are exactly the live requests by state."""
        total = 0
        for state, bucket in self._index.items():
            for rid, r in bucket.items():
                if r.state is not state or r.rid != rid or self._by_rid.get(rid) is not r:
                    raise AssertionError(
                        f"index: {rid!r} filed under {state.name} but is {r.state!r}"
                    )
            total += len(bucket)
        if total != len(self._by_rid):
            raise AssertionError(f"index: {total} requests filed, {len(self._by_rid)} live")


def _guards_hold(edge: Edge, req: Tracked) -> bool:
    return all(getattr(req, g)() for g in edge.conditions) and not any(
        getattr(req, g)() for g in edge.unless
    )


def _guard_report(edge: Edge, req: Tracked) -> str:
    failed = [f"{g} is false" for g in edge.conditions if not getattr(req, g)()]
    failed += [f"{g} is true" for g in edge.unless if getattr(req, g)()]
    return "; ".join(failed)
