"""Timelines: replay into transition records, Perfetto JSON, TTFT phases."""

from __future__ import annotations

import json

import attrs
import pytest

from lifecycle import (
    ADMITTED,
    PREFILL_TABLE,
    FailureReason,
    Lifecycle,
    PrefillRequest,
    PrefillState,
)
from lifecycle.testing import FakeClock
from lifecycle.timeline import (
    InvalidTimeline,
    Timed,
    TransitionRecord,
    TtftPhases,
    records,
    replayed_state,
    to_perfetto,
    ttft_phases,
)
from tests.strategies import prefill_request

P = PrefillState


def _clock() -> FakeClock:
    clock = FakeClock()
    clock.now = 10.0  # the records below read absolute times
    return clock


def _lifecycle(clock: FakeClock) -> Lifecycle[PrefillRequest]:
    return Lifecycle(
        PREFILL_TABLE, {"release": lambda r: None, "respond": lambda r: None}, clock=clock
    )


def _served(clock: FakeClock, lc: Lifecycle[PrefillRequest], rid: str) -> PrefillRequest:
    req = prefill_request(rid)
    lc.admit(req)
    for dt, event in ((0.5, "bootstrapped"), (0.25, "schedule"), (0.125, "chunk_done"),
                      (0.125, "prefilled"), (1.0, "transferred")):
        clock.now += dt
        if event == "prefilled":
            req.computed = len(req.input_ids)
        lc.trigger(req, event)
    return req


def test_records_replay_the_timeline_through_the_table() -> None:
    clock = _clock()
    lc = _lifecycle(clock)
    req = _served(clock, lc, "a")
    assert records(req) == [
        TransitionRecord("a", P.BOOTSTRAPPING, "bootstrapped", P.WAITING, 10.5),
        TransitionRecord("a", P.WAITING, "schedule", P.FORWARD, 10.75),
        TransitionRecord("a", P.FORWARD, "chunk_done", P.FORWARD, 10.875),
        TransitionRecord("a", P.FORWARD, "prefilled", P.TRANSFERRING, 11.0),
        TransitionRecord("a", P.TRANSFERRING, "transferred", P.DONE, 12.0),
    ]
    failed = prefill_request("b")
    lc.admit(failed)
    clock.now += 1
    failed.fail("no peer", reason=FailureReason.BOOTSTRAP_TIMEOUT)
    assert records(failed) == [
        TransitionRecord("b", P.BOOTSTRAPPING, "fail", P.FAILED, 13.0,
                         FailureReason.BOOTSTRAP_TIMEOUT)
    ]
    assert replayed_state(failed) is P.FAILED
    fresh = prefill_request("c")
    lc.admit(fresh)
    assert records(fresh) == [] and replayed_state(fresh) is P.BOOTSTRAPPING


def test_the_first_event_is_the_admission_and_reasons_print_their_wire_names() -> None:
    clock = _clock()
    lc = _lifecycle(clock)
    req = prefill_request("a")
    lc.admit(req)
    req.abort("the client went away", reason=FailureReason.ABORTED)
    assert [event for _, event in req.timeline] == [ADMITTED, "abort"]
    assert ADMITTED == "admitted"
    assert str(req.reason) == "aborted" and f"{req.reason}" == "aborted"
    assert repr(FailureReason.ABORTED) == "<FailureReason.ABORTED: 'aborted'>"
    assert {str(r) for r in FailureReason} == {r.value for r in FailureReason}


def test_a_timeline_the_table_cannot_take_is_reported() -> None:
    req = PrefillRequest("x", timeline=[(1.0, "admitted"), (2.0, "schedule")])
    with pytest.raises(InvalidTimeline, match="'x': step 1 takes event 'schedule' from BOOT"):
        records(req, PREFILL_TABLE)
    backwards = PrefillRequest("y", timeline=[(5.0, "admitted"), (4.0, "abort")])
    with pytest.raises(InvalidTimeline, match="goes back in time"):
        records(backwards, PREFILL_TABLE)
    with pytest.raises(InvalidTimeline, match="never admitted"):
        records(PrefillRequest("z"))


def test_perfetto_export_has_one_track_per_request_and_a_slice_per_state() -> None:
    clock = _clock()
    lc = _lifecycle(clock)
    done = _served(clock, lc, "a")
    live = prefill_request("b")
    lc.admit(live)
    clock.now += 2
    live.bootstrapped()
    trace = to_perfetto([done, live], now=clock.now + 1)
    json.dumps(trace)  # serializable as is
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {1: "a", 2: "b"}
    slices = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    assert slices == [
        (1, "BOOTSTRAPPING", 0.0, 500_000.0),
        (1, "WAITING", 500_000.0, 250_000.0),
        (1, "FORWARD", 750_000.0, 250_000.0),
        (1, "TRANSFERRING", 1_000_000.0, 1_000_000.0),
        (2, "BOOTSTRAPPING", 2_000_000.0, 2_000_000.0),
        (2, "WAITING", 4_000_000.0, 1_000_000.0),
    ]
    instants = [(e["tid"], e["name"], e["ts"]) for e in events if e["ph"] == "i"]
    assert instants == [(1, "chunk_done", 875_000.0), (1, "DONE", 2_000_000.0)]
    final = next(e for e in events if e["name"] == "DONE")
    assert final["args"] == {"rid": "a", "reason": None, "detail": ""}
    open_slice = [e for e in events if e["ph"] == "X"][-1]
    assert open_slice["args"] == {"rid": "b", "open": True}
    assert all(e["pid"] == 1 for e in events)
    assert to_perfetto([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


@attrs.frozen
class Answer:
    """A finished request's answer as a server hands it out: a copy of the timeline, no owner."""

    rid: str
    timeline: tuple[tuple[float, str], ...]
    reason: FailureReason | None
    detail: str


def _answer(req: PrefillRequest) -> Timed:
    return Answer(req.rid, tuple(req.timeline), req.reason, req.detail)


def test_an_answer_replays_and_exports_like_its_record_given_the_table() -> None:
    clock = _clock()
    lc = _lifecycle(clock)
    served = _served(clock, lc, "a")
    aborted = prefill_request("b")
    lc.admit(aborted)
    clock.now += 1
    aborted.fail("no peer", reason=FailureReason.BOOTSTRAP_TIMEOUT)
    answers = [_answer(served), _answer(aborted)]
    for req, answer in zip((served, aborted), answers, strict=True):
        assert records(answer, PREFILL_TABLE) == records(req)
        assert replayed_state(answer, PREFILL_TABLE) is req.state
    assert to_perfetto(answers, table=PREFILL_TABLE) == to_perfetto([served, aborted])
    final = next(e for e in to_perfetto(answers, table=PREFILL_TABLE)["traceEvents"]
                 if e["name"] == "FAILED")
    assert final["args"] == {"rid": "b", "reason": "bootstrap_timeout", "detail": "no peer"}
    with pytest.raises(InvalidTimeline, match=r"'a' was never admitted.*pass its table"):
        records(answers[0])
    with pytest.raises(InvalidTimeline, match="never admitted"):
        to_perfetto(answers)


def test_origin_puts_traces_on_one_time_axis() -> None:
    clock = _clock()
    lc = _lifecycle(clock)
    req = _served(clock, lc, "a")  # admitted at 10.0
    shifted = to_perfetto([req], origin=9.5, pid=2)["traceEvents"]
    plain = to_perfetto([req], pid=2)["traceEvents"]
    assert len(shifted) == len(plain)
    for moved, base in zip(shifted, plain, strict=True):
        if "ts" in base:
            assert moved == {**base, "ts": base["ts"] + 500_000.0}
        else:
            assert moved == base
    first = next(e for e in shifted if e["ph"] == "X")
    assert (first["name"], first["ts"], first["dur"]) == ("BOOTSTRAPPING", 500_000.0, 500_000.0)


def test_ttft_phases() -> None:
    clock = _clock()
    lc = _lifecycle(clock)
    req = _served(clock, lc, "a")
    phases = ttft_phases(req.timeline)
    assert phases == TtftPhases(bootstrap_wait=0.5, queue_wait=0.25, forward=0.25, transfer=1.0)
    assert phases.total == 2.0
    stuck = prefill_request("b")
    lc.admit(stuck)
    clock.now += 3
    stuck.bootstrapped()
    stuck.abort()
    partial = ttft_phases(stuck.timeline)
    assert partial == TtftPhases(bootstrap_wait=3.0, queue_wait=None, forward=None, transfer=None)
    assert partial.total is None
    assert ttft_phases([]) == TtftPhases(None, None, None, None)
