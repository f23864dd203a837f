"""The overlap loop on its production device thread, under CPU load.

The fuzzing machine steps the device itself so its searches replay; this test covers what that
leaves out: the real :class:`~scheduler.prefill.forward.DeviceWorker` thread, whose forwards
finish whenever the operating system lets them. A seeded random program (not Hypothesis: its
path may depend on thread timing, and that is the point) submits, aborts, moves the backend,
injects forward faults and steps, with a busy process and a busy thread beside it. Whatever the
timing, the invariants hold after every pass, and at the end every request was answered once
and every page, slot and sender is free again.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
from collections.abc import Iterator

import pytest

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from lifecycle import PrefillState
from lifecycle.testing import FakeClock
from scheduler.messages import NewRequest, Response
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch
from scheduler.testing.checks import check_pages, check_response
from scheduler.testing.fakes import (
    DECODE_HOST,
    PageEchoRunner,
    ScriptedKVManager,
    echo_next_token,
)
from scheduler.testing.setup import prompt_of
from tests.cpu_load import cpu_load

OPERATIONS = 3000
PAGES, PAGE_SIZE, SLOTS = 24, 4, 3


@pytest.fixture(autouse=True)
def _quiet_injected_failures() -> Iterator[None]:
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


class ThreadNotingRunner(PageEchoRunner):
    """The page-echo runner, noting the thread each forward ran on."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.threads: set[str] = set()

    def forward(self, batch: ForwardBatch) -> list[int]:
        self.threads.add(threading.current_thread().name)
        return super().forward(batch)


class Rig:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.runner = runner = ThreadNotingRunner(KVPool(
            num_layers=1, num_pages=PAGES, page_size=PAGE_SIZE, kv_heads=1, head_dim=1))
        self.kv = ScriptedKVManager(runner.pool)
        self.responses: list[Response] = []
        self.submitted: collections.Counter[str] = collections.Counter()
        self.sched = PrefillScheduler(
            config=SchedulerConfig(page_size=PAGE_SIZE, chunked_prefill_size=8,
                                   max_prefill_tokens=16, bootstrap_timeout=10.0,
                                   transfer_timeout=10.0, check_invariants=True),
            runner=runner, kv=self.kv, metadata=MetadataBuffers(SLOTS),
            slots=SlotAllocator(SLOTS), clock=self.clock, on_response=self.responses.append,
            overlap=True,  # the default device: the worker thread
        )

    def operate(self) -> None:
        rng, op = self.rng, self.rng.random()
        if op < 0.2:
            rid = f"r{len(self.submitted)}"
            self.submitted[rid] += 1
            self.sched.submit(NewRequest(
                rid, prompt_of(rid, rng.randint(1, 40)), bootstrap_host=DECODE_HOST,
                bootstrap_port=1, bootstrap_room=1000 + len(self.submitted),
            ))
        elif op < 0.3:
            live = sorted(r.rid for r in self.sched.lifecycle.live())
            self.sched.abort(rng.choice(live) if live else "never-submitted")
        elif op < 0.55:
            moves = [(s, a) for s in self.kv.senders for a in s.actions()]
            if moves:
                sender, action = rng.choice(moves)
                sender.act(action)
        elif op < 0.58:
            self.runner.fail_next = True
        elif op < 0.65:
            self.clock.now += rng.choice([0.5, 5.0, 11.0])
        else:
            self.sched.step()
            self.check()

    def check(self) -> None:
        self.sched.check_invariants()
        check_pages(self.sched, self.kv, self.runner)
        for req in self.sched.lifecycle.live():
            assert not req.on_device or req.state is PrefillState.FORWARD, req

    def quiesce(self) -> None:
        for _ in range(5000):
            if self.sched.idle():
                return
            for sender in self.kv.senders:
                for action in ("drain", "handshake", "success"):
                    if action in sender.actions():
                        sender.act(action)
            self.sched.step()
            self.clock.now += 0.5
            self.check()
        raise AssertionError("the scheduler did not quiesce in 5000 passes")


@pytest.mark.parametrize("seed", [1, 2])
def test_the_device_thread_under_load_keeps_the_invariants(seed: int) -> None:
    rig = Rig(seed)
    try:
        with cpu_load():
            for _ in range(OPERATIONS):
                rig.operate()
            rig.quiesce()
    finally:
        rig.sched.close()
    # The forwards ran on the worker thread, not inline.
    assert rig.runner.threads and all(t.startswith("pdlife-device") for t in rig.runner.threads)
    pool = rig.runner.pool
    assert pool.allocator.available() == pool.num_pages, "pages leaked"
    assert rig.sched.slots.available() == SLOTS, "metadata slots leaked"
    assert collections.Counter(r.rid for r in rig.responses) == rig.submitted
    assert all(s.cleared for s in rig.kv.senders)
    for resp in rig.responses:
        check_response(resp, pool, echo_next_token)
    outcomes = collections.Counter(r.reason.value if r.reason else "done" for r in rig.responses)
    # The program reached the paths that race with the device: aborts and forward failures.
    assert outcomes["done"] and outcomes["aborted"] and outcomes["internal"], outcomes
