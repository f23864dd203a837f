"""Property tests of the lifecycle machine through the public lifecycle.testing API: the stateful
machine on both shipped tables and on a table with after-hooks and guards of its own, and random
event sequences and legal walks at single requests."""

from __future__ import annotations

import enum

import attrs
from hypothesis import given

from lifecycle import (
    DECODE_TABLE,
    PREFILL_TABLE,
    Edge,
    FailureReason,
    IllegalTransition,
    Lifecycle,
    PrefillRequest,
    Tracked,
    make_table,
)
from lifecycle.testing import fuzz_settings, lifecycle_state_machine, satisfy_prefill_guards
from lifecycle.timeline import records
from tests.strategies import decode_request, event_sequences, legal_walks, prefill_request

STATEFUL = fuzz_settings(stateful_step_count=30)

TestPrefillLifecycle = lifecycle_state_machine(
    PREFILL_TABLE, prefill_request, satisfy=satisfy_prefill_guards
).TestCase
TestPrefillLifecycle.settings = STATEFUL

TestDecodeLifecycle = lifecycle_state_machine(DECODE_TABLE, decode_request).TestCase
TestDecodeLifecycle.settings = STATEFUL


# A table of another shape: an after-hook on an edge, a guarded retry loop, one failure event.
class Job(enum.IntEnum):
    LOST = 0
    QUEUED = 1
    RUNNING = 2
    FINISHED = 3


JOB_TABLE = make_table(
    "job",
    Job,
    initial=Job.QUEUED,
    finals=(Job.FINISHED, Job.LOST),
    edges=(
        Edge("start", Job.QUEUED, Job.RUNNING, after=("started",)),
        Edge("retry", Job.RUNNING, Job.QUEUED, conditions=("can_retry",), after=("requeued",)),
        Edge("finish", Job.RUNNING, Job.FINISHED),
        Edge("lose", Job.QUEUED, Job.LOST),
        Edge("lose", Job.RUNNING, Job.LOST),
    ),
    failure_events=("lose",),
    on_enter={Job.FINISHED: ("report",), Job.LOST: ("report",)},
)


@attrs.define(slots=True, eq=False, weakref_slot=False)
class JobRecord(Tracked):
    retries_left: int = attrs.field(default=0, kw_only=True)

    def can_retry(self) -> bool:
        return self.retries_left > 0


def _grant_retry(req: JobRecord, edge: Edge) -> None:
    if edge.event == "retry":
        req.retries_left = 1


TestJobLifecycle = lifecycle_state_machine(
    JOB_TABLE,
    JobRecord,
    hooks={"requeued": lambda r: setattr(r, "retries_left", r.retries_left - 1)},
    satisfy=_grant_retry,
).TestCase
TestJobLifecycle.settings = STATEFUL


@given(events=event_sequences(PREFILL_TABLE))
def test_random_events_at_one_request_follow_the_table(events: tuple[str, ...]) -> None:
    lc: Lifecycle[PrefillRequest] = Lifecycle(
        PREFILL_TABLE, {"release": lambda r: None, "respond": lambda r: None}
    )
    req = prefill_request("r")
    lc.admit(req)
    state = PREFILL_TABLE.initial
    taken = []
    for event in events:
        edge = PREFILL_TABLE.edge(state, event)
        if edge is not None:
            satisfy_prefill_guards(req, edge)
        reason = FailureReason.INTERNAL if event in PREFILL_TABLE.failure_events else None
        try:
            lc.trigger(req, event, reason=reason)
        except IllegalTransition:
            assert edge is None
            assert req.state is state
            continue
        assert edge is not None and req.state is edge.dest
        state = edge.dest
        taken.append(event)
    assert [r.event for r in records(req)] == taken
    assert (req.rid in lc) == (state not in PREFILL_TABLE.finals)


@given(walk=legal_walks(PREFILL_TABLE))
def test_legal_walks_are_taken_by_the_batch_path(walk: tuple[Edge, ...]) -> None:
    lc: Lifecycle[PrefillRequest] = Lifecycle(
        PREFILL_TABLE, {"release": lambda r: None, "respond": lambda r: None}, check=True
    )
    req = prefill_request("r")
    lc.admit(req)
    for edge in walk:
        satisfy_prefill_guards(req, edge)
        reason = FailureReason.ABORTED if edge.event in PREFILL_TABLE.failure_events else None
        lc.fire(edge.event, [req], reason=reason)
        assert req.state is edge.dest
    assert [(r.source, r.event, r.dest) for r in records(req)] == [
        (e.source, e.event, e.dest) for e in walk
    ]
