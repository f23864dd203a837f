"""Generated test paths: they cover every edge, and walking each on a real lifecycle gives, after
every step, exactly the whole state the table predicts (including resources by state)."""

from __future__ import annotations

from typing import Any

import pytest

from lifecycle import (
    DECODE_TABLE,
    PREFILL_TABLE,
    DecodeState,
    FailureReason,
    Lifecycle,
    LifecycleError,
    LifecycleTable,
    PrefillRequest,
    PrefillState,
)
from lifecycle.invariants import resource_violations
from lifecycle.paths import TestPath, edge_paths, shortest_paths_to
from lifecycle.testing import satisfy_prefill_guards
from tests.strategies import decode_request, prefill_request

P = PrefillState
PREFILL_PATHS = edge_paths(PREFILL_TABLE)


def test_prefill_paths_are_the_shortest_edge_cover() -> None:
    assert [p.name for p in PREFILL_PATHS] == [
        "fail",
        "abort",
        "bootstrapped>fail",
        "bootstrapped>abort",
        "bootstrapped>schedule>chunk_done",
        "bootstrapped>schedule>fail",
        "bootstrapped>schedule>abort",
        "bootstrapped>schedule>prefilled>transferred",
        "bootstrapped>schedule>prefilled>fail",
        "bootstrapped>schedule>prefilled>abort",
    ]


@pytest.mark.parametrize("table", [PREFILL_TABLE, DECODE_TABLE], ids=lambda t: t.name)
def test_paths_cover_every_edge_and_start_at_the_initial_state(table: LifecycleTable) -> None:
    paths = edge_paths(table)
    assert {e for p in paths for e in p.edges} == set(table.edges)
    assert len({p.events for p in paths}) == len(paths)
    for p in paths:
        assert p.edges[0].source is table.initial
        assert all(a.dest is b.source for a, b in zip(p.edges, p.edges[1:], strict=False))
    assert [len(p.edges) for p in paths] == sorted(len(p.edges) for p in paths)
    assert edge_paths(table) == paths  # deterministic


def test_shortest_paths_to_a_state() -> None:
    assert [p.name for p in shortest_paths_to(PREFILL_TABLE, P.FAILED)] == ["fail", "abort"]
    assert [p.name for p in shortest_paths_to(PREFILL_TABLE, P.DONE)] == [
        "bootstrapped>schedule>prefilled>transferred"
    ]
    assert shortest_paths_to(PREFILL_TABLE, P.BOOTSTRAPPING) == ()
    with pytest.raises(LifecycleError, match="not a state of this table"):
        shortest_paths_to(PREFILL_TABLE, DecodeState.PREALLOC)


class ResourceOwner:
    """What the scheduler and KV layer do at each step, reduced to the record's fields."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.responded: list[str] = []
        self.lc: Lifecycle[PrefillRequest] = Lifecycle(
            PREFILL_TABLE, {"release": self.release, "respond": self.respond}, check=True
        )

    def release(self, req: PrefillRequest) -> None:
        req.sender, req.slot, req.pages = None, None, []
        self.released.append(req.rid)

    def respond(self, req: PrefillRequest) -> None:
        self.responded.append(req.rid)

    def before(self, req: PrefillRequest, event: str) -> None:
        if event == "bootstrapped":
            req.slot = 0
        elif event == "schedule":
            req.pages = [0]
        elif event == "chunk_done":
            req.pages.append(len(req.pages))


@pytest.mark.parametrize("path", PREFILL_PATHS, ids=lambda p: p.name)
def test_walk_prefill_path_asserting_the_whole_state(path: TestPath) -> None:
    owner = ResourceOwner()
    req = prefill_request("r")
    req.sender = object()
    owner.lc.admit(req)
    assert resource_violations(req) == []
    expected_timeline = ["admitted"]
    for step, edge in enumerate(path.edges, start=1):
        satisfy_prefill_guards(req, edge)
        owner.before(req, edge.event)
        reason = FailureReason.INTERNAL if edge.event in PREFILL_TABLE.failure_events else None
        owner.lc.trigger(req, edge.event, reason=reason)
        expected_timeline.append(edge.event)
        final = edge.dest in PREFILL_TABLE.finals
        whole: dict[str, Any] = {
            "state": req.state,
            "timeline": [e for _, e in req.timeline],
            "live": len(owner.lc),
            "counts": {s: n for s, n in owner.lc.counts().items() if n},
            "finished": dict(+owner.lc.finished),
            "released": owner.released,
            "responded": owner.responded,
            "reason": req.reason,
        }
        assert whole == {
            "state": edge.dest,
            "timeline": expected_timeline,
            "live": 0 if final else 1,
            "counts": {} if final else {edge.dest: 1},
            "finished": {(edge.dest, reason): 1} if final else {},
            "released": ["r"] if final else [],
            "responded": ["r"] if final else [],
            "reason": reason,
        }, f"after step {step} ({edge.event})"
        assert resource_violations(req) == [], f"after step {step} ({edge.event})"


@pytest.mark.parametrize("path", edge_paths(DECODE_TABLE), ids=lambda p: p.name)
def test_walk_decode_path(path: TestPath) -> None:
    lc = Lifecycle(DECODE_TABLE, {"release": lambda r: None, "respond": lambda r: None})
    req = decode_request("d")
    lc.admit(req)
    for edge in path.edges:
        failing = edge.event in DECODE_TABLE.failure_events
        reason = FailureReason.TRANSFER_FAILED if failing else None
        lc.fire(edge.event, [req], reason=reason)
        assert req.state is edge.dest
        assert lc.counts() == {
            s: int(s is edge.dest) for s in DECODE_TABLE.live_states()
        }
    assert req.state is path.states[-1]
