"""The deadline heap: stale entries (re-armed, disarmed, finished requests) are dropped once
they outnumber the live admissions, and what expires is the same as without the rebuild."""

from __future__ import annotations

from kv.fake import FakeKVManager, FaultPlan
from lifecycle import PREFILL_TABLE, FailureReason, Lifecycle, PrefillEvent, PrefillRequest
from scheduler.messages import NewRequest
from scheduler.prefill.admission import Admission
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.prefill.readiness import Deadlines

BOOTSTRAP_TIMEOUT = 100.0


class Registry:
    """A real Admission over a real lifecycle whose decode peer never answers; the clock is
    a number the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.deadlines = Deadlines()
        self.lifecycle: Lifecycle[PrefillRequest] = Lifecycle(
            PREFILL_TABLE, {"release": self._release, "respond": lambda req: None},
            clock=lambda: self.now,
        )
        self.admission = Admission(
            lifecycle=self.lifecycle, config=SchedulerConfig(bootstrap_timeout=BOOTSTRAP_TIMEOUT),
            num_pages=64, kv=FakeKVManager(FaultPlan(bootstrap_timeout=1.0)), fake_kv=None,
            arm_deadline=self.deadlines.arm, clock=lambda: self.now,
            metrics=SchedulerMetrics(), respond=lambda response: None,
        )

    def _release(self, req: PrefillRequest) -> None:
        forget_room = self.admission.forget(req)
        if forget_room is not None:
            forget_room()

    def admit(self, first: int, count: int) -> list[PrefillRequest]:
        for i in range(first, first + count):
            self.admission.admit(NewRequest(f"r{i}", (1, 2, 3), bootstrap_host="decode",
                                            bootstrap_room=i + 1))
        reqs = [r for r in self.lifecycle.live() if int(r.rid[1:]) >= first]
        assert len(reqs) == count
        return reqs

    def fail(self, reqs: list[PrefillRequest]) -> None:
        self.lifecycle.fire(PrefillEvent.FAIL, reqs, reason=FailureReason.ABORTED, detail="test")


def test_finished_requests_entries_are_dropped_and_live_ones_still_expire() -> None:
    reg = Registry()
    live = reg.admit(0, 10)
    # Many requests pass through, each leaving its bootstrap deadline behind.
    for round_ in range(30):
        reg.now = float(round_)
        reg.fail(reg.admit(1000 + 100 * round_, 100))
        assert reg.deadlines.expired(reg.now, reg.admission) == set()
        assert len(reg.deadlines) <= 2 * len(reg.admission) + Deadlines.STALE_SLACK + 100
    assert len(reg.admission) == 10
    # The latest rebuild kept the live entries and dropped most of the 3,000 stale ones.
    assert len(reg.deadlines) < 10 + Deadlines.STALE_SLACK + 100
    seqs = {reg.admission.seq_of(r) for r in live}
    assert reg.deadlines.expired(BOOTSTRAP_TIMEOUT - 0.5, reg.admission) == set()
    assert reg.deadlines.expired(BOOTSTRAP_TIMEOUT, reg.admission) == seqs


def test_rebuild_keeps_the_latest_deadline_of_a_rearmed_request() -> None:
    reg = Registry()
    live = reg.admit(0, 3)
    seqs = [reg.admission.seq_of(r) for r in live]
    # Re-armed 1,000 times each, the same deadline twice in a row (one entry after the rebuild).
    for k in range(1, 1001):
        for req, seq in zip(live, seqs, strict=True):
            reg.deadlines.arm(req, seq, 1000.0 + k)
            reg.deadlines.arm(req, seq, 1000.0 + k)
    Deadlines.disarm(live[2])
    assert len(reg.deadlines) == 3 + 6000
    assert reg.deadlines.expired(0.0, reg.admission) == set()
    assert len(reg.deadlines) == 2  # the third was disarmed: none of its entries count
    assert reg.deadlines.expired(1999.0, reg.admission) == set()
    assert reg.deadlines.expired(2000.0, reg.admission) == set(seqs[:2])
    assert len(reg.deadlines) == 0


def test_no_rebuild_while_stale_entries_stay_within_the_slack() -> None:
    reg = Registry()
    (req,) = reg.admit(0, 1)
    seq = reg.admission.seq_of(req)
    for k in range(Deadlines.STALE_SLACK):
        reg.deadlines.arm(req, seq, 500.0 + k)
    held = len(reg.deadlines)
    assert reg.deadlines.expired(0.0, reg.admission) == set()
    assert len(reg.deadlines) == held
