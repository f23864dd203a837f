"""Per-request timelines: transition records, Perfetto traces and TTFT phases.

Theory of operation
-------------------
A request stores only ``(monotonic_time, event)`` pairs (admission first, with event
``"admitted"``, :data:`~lifecycle.record.ADMITTED`):
every ``(state, event)`` pair of a table has one destination, so the states follow from
replaying the events through the table from its initial state. :func:`records` does that replay
and returns one :class:`TransitionRecord` per transition; a timeline that takes an edge the table
does not have is reported as :class:`~lifecycle.errors.InvalidTimeline` (it cannot happen through
:class:`~lifecycle.machine.Lifecycle`, which is why the property tests replay every timeline).

The replay reads only a request's id, timeline, failure reason and detail (:class:`Timed`), so it
works alike on a live :class:`~lifecycle.record.Tracked` record and on a finished request's answer
that carries a copy of its timeline; only a record still owned by a lifecycle knows its table, the
others need ``table=``.

Everything here is pure: :func:`to_perfetto` returns the Chrome-trace JSON object and the caller
writes it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

from lifecycle.errors import LifecycleError
from lifecycle.record import ADMITTED, Tracked
from lifecycle.table import LifecycleTable


class InvalidTimeline(LifecycleError):
    """A timeline does not replay through its table; the message names the request and step."""


@attrs.frozen
class TransitionRecord:
    """One transition of one request: ``event`` moved it from ``source`` to ``dest`` at
    monotonic ``time``. ``reason`` is the request's failure reason on the transition into a
    final state, else ``None``."""

    rid: str
    source: enum.IntEnum
    event: str
    dest: enum.IntEnum
    time: float
    reason: enum.Enum | None = None


class Timed(Protocol):
    """What a timeline is read from: the request id, the ``(monotonic_time, event)`` pairs
    (admission first, with event ``"admitted"``), and the failure reason and detail it ended with.
    :class:`~lifecycle.record.Tracked` records have them, and so do answers that copy them."""

    @property
    def rid(self) -> str: ...

    @property
    def timeline(self) -> Sequence[tuple[float, str]]: ...

    @property
    def reason(self) -> enum.Enum | None: ...

    @property
    def detail(self) -> str: ...


def _table_of(req: Timed, table: LifecycleTable | None) -> LifecycleTable:
    if table is not None:
        return table
    owner = req.owner if isinstance(req, Tracked) else None
    if owner is None:
        raise InvalidTimeline(
            f"request {req.rid!r} was never admitted to a lifecycle, so its table is unknown; "
            f"pass its table"
        )
    return owner.table


def records(req: Timed, table: LifecycleTable | None = None) -> list[TransitionRecord]:
    """Replay ``req``'s timeline through ``table`` (default: the table of the lifecycle that
    owns ``req``, for a :class:`~lifecycle.record.Tracked` record)."""
    table = _table_of(req, table)
    timeline = req.timeline
    if not timeline:
        return []
    admitted_at, first = timeline[0]
    if first != ADMITTED:
        raise InvalidTimeline(f"request {req.rid!r}: the timeline does not start with admission")
    state = table.initial
    last = admitted_at
    out: list[TransitionRecord] = []
    for step, (t, event) in enumerate(timeline[1:], start=1):
        edge = table.lookup.get((state, event))
        if edge is None:
            raise InvalidTimeline(
                f"request {req.rid!r}: step {step} takes event {str(event)!r} from {state.name}, "
                f"which table {table.name!r} has no edge for"
            )
        if t < last:
            raise InvalidTimeline(f"request {req.rid!r}: step {step} goes back in time")
        final = edge.dest in table.finals
        out.append(
            TransitionRecord(
                rid=req.rid,
                source=state,
                event=event,
                dest=edge.dest,
                time=t,
                reason=req.reason if final else None,
            )
        )
        state = edge.dest
        last = t
    return out


def replayed_state(req: Timed, table: LifecycleTable | None = None) -> enum.IntEnum:
    """The state ``req``'s timeline ends in (the table's initial state if only admitted)."""
    recs = records(req, table)
    return recs[-1].dest if recs else _table_of(req, table).initial


# -- Chrome trace / Perfetto ----------------------------------------------------------------


def to_perfetto(
    requests: Iterable[Timed],
    *,
    table: LifecycleTable | None = None,
    now: float | None = None,
    pid: int = 1,
    origin: float | None = None,
    process: str | None = None,
) -> dict[str, Any]:
    """A Chrome-trace JSON object (``json.dump`` it; Perfetto and chrome://tracing open it).

    One thread track per request (``tid`` = its position, named by its rid), one complete
    ``"X"`` slice per state visit from entry to exit, self-loops (a chunk) and final states as
    instant events. Times are microseconds since ``origin``, a monotonic time (default: the
    earliest admission here); pass the same ``origin`` to traces that are to share a time axis
    (e.g. both sides of a disaggregated pair, as separate ``pid``s). A live request's current
    state ends at ``now`` (default: the latest time in any timeline) with ``args.open = true``.
    ``table`` is needed for requests no lifecycle owns (e.g. answers carrying a timeline).
    ``process`` names the process track (default: the name of the table of the first request).
    """
    reqs = [r for r in requests if r.timeline]
    if not reqs:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    axis = _Axis(
        pid=pid,
        zero=origin if origin is not None else min(r.timeline[0][0] for r in reqs),
        end=now if now is not None else max(r.timeline[-1][0] for r in reqs),
    )
    if process is None:
        process = _table_of(reqs[0], table).name
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}
    ]
    for tid, req in enumerate(reqs, start=1):
        events += axis.track(tid, req, _table_of(req, table))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


@attrs.frozen
class _Axis:
    """One process's time axis in a trace: microseconds since ``zero``; open stays end at
    ``end``."""

    pid: int
    zero: float
    end: float

    def us(self, t: float) -> float:
        return round((t - self.zero) * 1e6, 3)

    def visit(
        self, tid: int, cat: str, state: enum.IntEnum, start: float, stop: float,
        args: dict[str, Any],
    ) -> dict[str, Any]:
        """One complete slice: the stay in ``state`` from ``start`` to ``stop``."""
        return {
            "ph": "X", "pid": self.pid, "tid": tid, "cat": cat, "name": state.name,
            "ts": self.us(start), "dur": round(max(stop - start, 0.0) * 1e6, 3), "args": args,
        }

    def track(self, tid: int, req: Timed, tbl: LifecycleTable) -> list[dict[str, Any]]:
        """The events of one request's track: its name, a slice per state, instants."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid,
             "args": {"name": req.rid}}
        ]
        entered_state, entered_at = tbl.initial, req.timeline[0][0]
        for rec in records(req, tbl):
            base = {"pid": self.pid, "tid": tid, "cat": tbl.name, "ts": self.us(rec.time)}
            if rec.dest is rec.source:
                events.append(
                    {**base, "ph": "i", "s": "t", "name": rec.event, "args": {"rid": rec.rid}}
                )
                continue
            left = {"rid": rec.rid, "exit": rec.event}
            events.append(self.visit(tid, tbl.name, entered_state, entered_at, rec.time, left))
            entered_state, entered_at = rec.dest, rec.time
            if rec.dest in tbl.finals:
                args = {"rid": rec.rid, "reason": _reason_name(rec.reason), "detail": req.detail}
                events.append({**base, "ph": "i", "s": "t", "name": rec.dest.name, "args": args})
        if entered_state not in tbl.finals:
            still_open = {"rid": req.rid, "open": True}
            events.append(self.visit(tid, tbl.name, entered_state, entered_at, self.end,
                                     still_open))
        return events


def _reason_name(reason: enum.Enum | None) -> str | int | None:
    # The value when it is JSON-friendly (FailureReason's wire names), else the member name.
    if reason is None:
        return None
    value = reason.value
    return value if isinstance(value, (str, int)) else reason.name


# -- TTFT phases ----------------------------------------------------------------------------

# The prefill events that end each phase of the time to first token.
_PHASE_ENDS = ("bootstrapped", "schedule", "prefilled", "transferred")


@attrs.frozen
class TtftPhases:
    """Where a prefill request's time to first token went, in seconds; ``None`` for a phase
    the request did not complete.

    ``bootstrap_wait`` admission → bootstrapped; ``queue_wait`` bootstrapped → schedule;
    ``forward`` schedule → prefilled (all chunks); ``transfer`` prefilled → transferred.
    """

    bootstrap_wait: float | None
    queue_wait: float | None
    forward: float | None
    transfer: float | None

    @property
    def total(self) -> float | None:
        """Admission → transferred, when the request got that far."""
        parts = (self.bootstrap_wait, self.queue_wait, self.forward, self.transfer)
        return None if None in parts else sum(p for p in parts if p is not None)


def ttft_phases(timeline: Sequence[tuple[float, str]]) -> TtftPhases:
    """The TTFT phases of a prefill request's ``(time, event)`` timeline."""
    if not timeline:
        return TtftPhases(None, None, None, None)
    # First occurrence of each phase-ending event (each occurs at most once on the table).
    at: dict[str, float] = {}
    for t, event in timeline:
        at.setdefault(event, t)
    marks = [at.get(ADMITTED)] + [at.get(e) for e in _PHASE_ENDS]
    spans: list[float | None] = []
    for start, stop in itertools.pairwise(marks):
        spans.append(stop - start if start is not None and stop is not None else None)
    return TtftPhases(*spans)
