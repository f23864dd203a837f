"""The lifecycle invariants as checks: timelines, hook counts, resources by state.

Each check returns the list of violations it found (empty when the invariant holds), so a
property test can assert on it and a debug mode can log it. They read the same tables as the
machine; nothing here changes a request.

The prefill ownership table (:data:`PREFILL_RESOURCES`) is data: the docs print it and
:func:`resource_violations` checks a :class:`~lifecycle.prefill.PrefillRequest` against it,
which the owner does once its ``release`` hook has cleared the request's fields.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import attrs

from lifecycle.prefill import PrefillRequest, PrefillState
from lifecycle.record import Tracked
from lifecycle.table import LifecycleTable
from lifecycle.timeline import InvalidTimeline, records


@attrs.frozen
class Holding:
    """What a request holds in one state: its KV sender, its metadata slot, its KV pages, and
    ``state``: where the model keeps state beside full attention (``kv.state_pools``), the SWA
    pages of its KV pages and its recurrent-state slot, which may be held only here."""

    sender: bool
    slot: bool
    pages: bool
    state: bool = False
    note: str = ""


_P = PrefillState

#: Resources by state (DESIGN.md "The prefill lifecycle"); final states hold nothing.
PREFILL_RESOURCES: Mapping[PrefillState, Holding] = {
    _P.BOOTSTRAPPING: Holding(sender=True, slot=False, pages=False),
    _P.WAITING: Holding(sender=True, slot=True, pages=False),
    _P.FORWARD: Holding(sender=True, slot=True, pages=True, state=True,
                        note="pages grow per chunk; state taken with the first pages"),
    _P.TRANSFERRING: Holding(
        sender=True, slot=True, pages=True, state=True,
        note="pages and state held until the transfer stops reading",
    ),
    _P.DONE: Holding(sender=False, slot=False, pages=False, note="all released, once"),
    _P.FAILED: Holding(sender=False, slot=False, pages=False, note="all released, once"),
}


def resource_violations(req: PrefillRequest) -> list[str]:
    """How ``req``'s sender, slot, pages and state slot differ from :data:`PREFILL_RESOURCES`
    (a state slot is optional where the table allows one: the model may have no recurrent
    layers; its owner checks that a request that should hold one does)."""
    state = req.state
    if not isinstance(state, PrefillState):
        return [f"{req.rid}: not in a prefill state ({state!r})"]
    want = PREFILL_RESOURCES[state]
    have = Holding(
        sender=req.sender is not None, slot=req.slot is not None, pages=bool(req.pages)
    )
    out = []
    for name in ("sender", "slot", "pages"):
        if getattr(want, name) != getattr(have, name):
            verb = "should hold" if getattr(want, name) else "should not hold"
            out.append(f"{req.rid}: in {state.name} {verb} its {name}")
    if req.state_slot is not None and not want.state:
        out.append(f"{req.rid}: in {state.name} should not hold its state slot")
    return out


def timeline_violations(req: Tracked, table: LifecycleTable) -> list[str]:
    """Invariants 1, 2 and 5 for one request: its timeline replays through ``table`` (only
    table edges, monotone times), ends in the request's current state, and enters a final
    state at most once, as its last step."""
    try:
        recs = records(req, table)
    except InvalidTimeline as exc:
        return [str(exc)]
    out = []
    end = recs[-1].dest if recs else table.initial
    if req.timeline and end is not req.state:
        out.append(f"{req.rid}: the timeline ends in {end.name}, the request is in {req.state!r}")
    finals = [i for i, r in enumerate(recs) if r.dest in table.finals]
    if len(finals) > 1 or (finals and finals[0] != len(recs) - 1):
        out.append(f"{req.rid}: entered a final state {len(finals)} times or then moved on")
    return out


def expected_hook_calls(req: Tracked, table: LifecycleTable) -> collections.Counter[str]:
    """How many times each hook must have run for ``req``: the ``after`` hooks of every edge
    it took plus the ``on_enter`` hooks of every state it entered."""
    calls: collections.Counter[str] = collections.Counter()
    for rec in records(req, table):
        calls.update(table.hooks_of(table.lookup[(rec.source, rec.event)]))
    return calls

