"""Regression tests for what the scheduler fuzzer (``scheduler.testing.machine``) found.

Each test is named for what it caught and replays the shrunk program by hand, so it fails
without Hypothesis if the bug comes back. docs/fuzzing.md lists them.
"""

from __future__ import annotations

from kv.metadata import MetadataBuffers, SlotAllocator
from lifecycle import FailureReason, PrefillState
from lifecycle.testing import FakeClock
from scheduler.messages import NewRequest, Response
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.testing.fakes import (
    DECODE_HOST,
    ScriptedKVManager,
    echo_next_token,
    echo_runner_factory,
)

S = PrefillState


class Rig:
    """A scheduler on the scripted backend and the page-echo runner."""

    def __init__(self, *, pages: int = 8, slots: int = 2) -> None:
        self.clock = FakeClock()
        self.responses: list[Response] = []
        runner = echo_runner_factory(pages, 4)
        self.pool = runner.pool
        self.kv = ScriptedKVManager(self.pool)
        self.sched = PrefillScheduler(
            config=SchedulerConfig(page_size=4, chunked_prefill_size=8, check_invariants=True),
            runner=runner, kv=self.kv, metadata=MetadataBuffers(slots),
            slots=SlotAllocator(slots), clock=self.clock, on_response=self.responses.append,
        )

    def submit(self, rid: str, n: int, room: int) -> None:
        self.sched.submit(NewRequest(rid, tuple(range(1, n + 1)), bootstrap_host=DECODE_HOST,
                                     bootstrap_port=1, bootstrap_room=room))

    def step(self) -> None:
        self.sched.step()
        self.sched.check_invariants()

    def answer(self, rid: str) -> Response:
        (resp,) = [r for r in self.responses if r.rid == rid]
        return resp


def test_a_room_reused_while_its_aborted_transfer_still_reads_is_rejected_not_a_backend_misuse():
    rig = Rig()
    rig.submit("a", 6, room=7)
    rig.step()
    (sender,) = rig.kv.senders
    sender.act("handshake")
    rig.step()  # bootstrapped, computed, pages handed to the transfer engine
    assert rig.sched.lifecycle.get("a").state is S.TRANSFERRING  # type: ignore[union-attr]
    assert sender.reading
    rig.sched.abort("a")
    rig.step()  # FAILED; the engine may still read the pages: they stay quarantined
    assert rig.answer("a").reason is FailureReason.ABORTED
    assert rig.pool.allocator.available() == rig.pool.num_pages - 2
    rig.submit("b", 3, room=7)
    rig.step()
    b = rig.answer("b")
    # The room is still in use by the draining transfer: a client error, like any room in use,
    # never a call that breaks the transfer contract (TransferUsageError, answered 500).
    assert b.reason is FailureReason.REJECTED and "in use" in b.detail, b
    sender.act("drain")
    rig.step()
    assert rig.pool.allocator.available() == rig.pool.num_pages
    rig.submit("c", 3, room=7)  # once the engine let go, the room is free again
    rig.step()
    rig.kv.senders[-1].act("handshake")
    rig.step()
    rig.kv.senders[-1].act("success")
    rig.step()
    c = rig.answer("c")
    assert c.ok and c.first_token == echo_next_token(range(1, 4))
    assert rig.sched.idle()
