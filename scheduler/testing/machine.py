"""Property-based testing of the whole prefill scheduler: a Hypothesis stateful machine.

``lifecycle.testing`` fuzzes lifecycle *tables* (one :class:`~lifecycle.Lifecycle`, events
fired by hand). This module fuzzes the *scheduler*: a real
:class:`~scheduler.prefill.PrefillScheduler` with a real model runner (or any
:class:`~scheduler.runner.ModelRunner`) and a transfer backend whose every move the test
decides. It lives in ``scheduler/`` because ``lifecycle/`` may not import upward. An embedder
points it at their own configuration::

    from scheduler.prefill.config import SchedulerConfig
    from scheduler.testing.machine import scheduler_machine

    TestMyScheduler = scheduler_machine(
        config=SchedulerConfig(page_size=4, chunked_prefill_size=8, check_invariants=True),
        runner_factory=lambda num_pages, page_size: MyRunner(num_pages, page_size),
    ).TestCase

Theory of operation
-------------------
The scheduler is driven only through its public surface (``submit``, ``abort``, ``step``) and
its boundaries: the injected clock (:class:`~lifecycle.testing.FakeClock`), the model runner,
and the KV managers. Requests go to one of two managers: :class:`ScriptedKVManager`, whose
senders change state only when a rule says so (handshake, bootstrap failure or timeout,
transfer failure, the engine finishing its reads, success), and the seeded
:class:`~kv.fake.FakeKVManager` on the fake host ``2.2.2.2`` with a
:class:`~kv.fake.FaultPlan`. A scripted sender keeps reading the pages it was sent until a rule
drains it, so aborts and failures land while pages are being transferred; under the overlap loop
a batch stays on the device between passes, so aborts land while a forward may write pages.

After every rule the machine checks invariants 1 to 5 of ``docs/architecture.md`` (invariant 6,
ranks agreeing, is covered by the TP tests): one response per admission, entering one final
state once; every timeline replays through the prefill table, monotone; conservation of pages
and slots (``check_invariants``) plus ownership by state
(``lifecycle.invariants.resource_violations``); no page free while a forward or a transfer may
touch it; the per-state collections equal the states; after a pass, no live request past its
state's deadline. At teardown it drives the
scheduler to quiescence and asserts every pool is full again and every sender was cleared.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv.fake import FakeKVManager, FaultPlan
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pages import pages_needed
from lifecycle import PREFILL_TABLE, FailureReason, PrefillRequest, PrefillState
from lifecycle.invariants import resource_violations, timeline_violations
from lifecycle.testing import FakeClock
from scheduler.messages import FAKE_BOOTSTRAP_HOST, NewRequest, Response
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.testing.fakes import (
    DECODE_HOST,
    PageEchoRunner,
    Reference,
    RunnerFactory,
    ScriptedKVManager,
    ScriptedSender,
    echo_next_token,
    echo_runner_factory,
)

S = PrefillState

# -- configuration ---------------------------------------------------------------------------

LOOPS = ("normal", "overlap", "both")
#: The fake host's faults by default: every kind, often, with delays on the clock.
FAKE_HOST_FAULTS = FaultPlan(
    seed=1, bootstrap_failure=0.2, bootstrap_timeout=0.1, transfer_failure=0.2,
    handshake_delay_polls=1, transfer_delay_s=0.5,
)
_QUIESCE_PASSES = 200


@attrs.frozen
class MachineSetup:
    """What a :class:`SchedulerMachine` runs; fields left None are drawn per example."""

    config: SchedulerConfig | None = None
    runner_factory: RunnerFactory = echo_runner_factory
    reference: Reference | None = echo_next_token
    pages: int | None = attrs.field(default=None)
    slots: int | None = None
    loop: str = attrs.field(default="both", validator=attrs.validators.in_(LOOPS))
    faults: FaultPlan = attrs.field(factory=lambda: FAKE_HOST_FAULTS)

    @pages.validator
    def _check_pages(self, _attr: object, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"MachineSetup.pages must be >= 1 or None, got {value}")


def scheduler_configs(page_size: int = 4) -> st.SearchStrategy[SchedulerConfig]:
    """Small budgets that make chunking, page exhaustion and the batch caps likely."""
    return st.builds(
        SchedulerConfig,
        page_size=st.just(page_size),
        chunked_prefill_size=st.sampled_from([None, page_size, 2 * page_size, 3 * page_size]),
        max_prefill_tokens=st.sampled_from([page_size, 4 * page_size, 16384]),
        max_running_requests=st.sampled_from([1, 2, 8]),
        prefill_max_requests=st.sampled_from([None, 1, 2]),
        bootstrap_timeout=st.just(10.0),
        transfer_timeout=st.just(10.0),
        check_invariants=st.just(True),
    )


def prompt_of(rid: str, length: int) -> tuple[int, ...]:
    """The prompt a submission of ``rid`` with ``length`` tokens carries (reproducible, so a
    response can be checked against the reference from its rid and token count)."""
    salt = sum(map(ord, rid))
    return tuple((salt + 7 * i * i + 3 * i) % 256 for i in range(length))


# -- the machine -----------------------------------------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """See the module docstring. Use :func:`scheduler_machine` to configure one."""

    setup: ClassVar[MachineSetup] = MachineSetup()

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.sched: PrefillScheduler | None = None
        self.responses: list[Response] = []
        self.submitted: collections.Counter[str] = collections.Counter()
        # Request objects seen live and not yet checked in a final state, by id.
        self.seen: dict[int, PrefillRequest] = {}
        self.rooms: dict[str, list[int]] = {DECODE_HOST: [], FAKE_BOOTSTRAP_HOST: []}
        self.serial = 0
        # Aborts of live requests since the last pass, with the failure each already had.
        self._aborted: list[tuple[PrefillRequest, FailureReason | None]] = []
        self._checked = 0  # responses checked so far

    # -- building ---------------------------------------------------------------------------

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        s = self.setup
        config = s.config or data.draw(scheduler_configs(), label="config")
        ps = config.page_size
        self.pages = s.pages or data.draw(st.integers(2, 24), label="pages")
        num_slots = s.slots or data.draw(st.integers(1, 4), label="slots")
        overlap = {"normal": False, "overlap": True}.get(s.loop)
        if overlap is None:
            overlap = data.draw(st.booleans(), label="overlap")
        self.runner = s.runner_factory(self.pages, ps)
        self.pool = self.runner.pool
        self.capacity = self.pool.num_pages * ps
        self.scripted = ScriptedKVManager(self.pool)
        self.fake = FakeKVManager(s.faults, clock=self.clock)
        self.config = config
        self.sched = PrefillScheduler(
            config=config, runner=self.runner, kv=self.scripted, fake_kv=self.fake,
            metadata=MetadataBuffers(num_slots), slots=SlotAllocator(num_slots),
            clock=self.clock, on_response=self.responses.append, overlap=overlap,
        )

    def teardown(self) -> None:
        sched = self.sched
        if sched is None:
            return
        try:
            self._quiesce(sched)
        finally:
            sched.close()

    def _quiesce(self, sched: PrefillScheduler) -> None:
        """Let every transfer conclude and every deadline pass; then all pools are full."""
        # Time moves a little every pass (the fake host's delays are on the clock) and a lot
        # after a few passes that did nothing (so stuck handshakes reach their deadline).
        resting = 0
        for _ in range(_QUIESCE_PASSES):
            if sched.idle():
                break
            for sender in self.scripted.senders:
                for action in ("drain", "handshake", "success"):
                    if action in sender.actions():
                        sender.act(action)
            resting = 0 if sched.step() else resting + 1
            self.clock.now += 0.5 if resting < 3 else max(self.config.bootstrap_timeout,
                                                          self.config.transfer_timeout)
            self.check_everything()
        assert sched.idle(), f"the scheduler did not quiesce in {_QUIESCE_PASSES} passes"
        assert self.pool.allocator.available() == self.pool.num_pages, "pages leaked"
        assert sched.slots.available() == sched.slots.num_slots, "metadata slots leaked"
        assert sched.pages_held == 0
        answered = collections.Counter(r.rid for r in self.responses)
        assert answered == self.submitted, f"answers {answered} != submissions {self.submitted}"
        uncleared = [s.room for s in self.scripted.senders if not s.cleared]
        assert not uncleared, f"senders of rooms {uncleared} never cleared"

    # -- rules ------------------------------------------------------------------------------

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data(), n=st.integers(1, 3))
    def submit(self, data: st.DataObject, n: int) -> None:
        """New requests: any length (empty and too long too), fresh or reused rooms and ids,
        to the scripted peer or the fake host."""
        assert self.sched is not None
        for _ in range(n):
            rid = self._draw_rid(data)
            cap = self.capacity
            length = data.draw(st.one_of(
                st.integers(1, 3 * self.config.page_size), st.integers(1, cap),
                st.sampled_from([0, cap, cap + 1]),
            ), label="length")
            host = data.draw(st.sampled_from([DECODE_HOST] * 3 + [FAKE_BOOTSTRAP_HOST]),
                             label="host")
            used = self.rooms[host]
            self.serial += 1
            room = 1000 + self.serial
            if bool(used) and data.draw(st.booleans(), label="reuse room"):
                room = data.draw(st.sampled_from(used), label="reused room")
            used.append(room)
            self.submitted[rid] += 1
            self.sched.submit(NewRequest(rid, prompt_of(rid, length), bootstrap_host=host,
                                         bootstrap_port=1, bootstrap_room=room))

    def _draw_rid(self, data: st.DataObject) -> str:
        if self.submitted and data.draw(st.integers(0, 5), label="reuse rid") == 0:
            return data.draw(st.sampled_from(sorted(self.submitted)), label="rid")
        return f"r{len(self.submitted) + 1}"

    @precondition(lambda self: self.sched is not None)
    @rule()
    def step(self) -> None:
        """One pass; then the per-pass checks (deadlines, aborts took effect)."""
        assert self.sched is not None
        pending = list(self._aborted)
        self._aborted.clear()
        self.sched.step()
        self._track()
        self._check_deadlines()
        for req, earlier in pending:
            if req.is_final:
                assert req.reason is FailureReason.ABORTED or earlier is not None, (
                    f"{req.rid}: aborted while live, ended {req.reason}"
                )
            else:
                assert req.pending_abort is not None and req.on_device > 0, (
                    f"{req.rid}: an abort was received but {req.state!r} stays live, "
                    f"on_device={req.on_device}"
                )

    @precondition(lambda self: self.sched is not None and bool(self.submitted))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Abort a live request (in any state, also on the device or mid-transfer), a
        finished one, or one never seen."""
        assert self.sched is not None
        live = list(self.sched.lifecycle.live())
        choice = data.draw(st.sampled_from(["live"] * 3 + ["any", "unknown"]), label="target")
        if choice == "live" and live:
            req = data.draw(st.sampled_from(live), label="victim")
            self._aborted.append((req, req.pending_abort))
            rid = req.rid
        elif choice == "unknown":
            rid = "never-submitted"
        else:
            rid = data.draw(st.sampled_from(sorted(self.submitted)), label="rid")
        self.sched.abort(rid)

    def _backend_moves(self) -> list[tuple[ScriptedSender, str]]:
        if self.sched is None:
            return []
        return [(s, a) for s in self.scripted.senders for a in s.actions()]

    @precondition(lambda self: bool(self._backend_moves()))
    @rule(data=st.data())
    def backend(self, data: st.DataObject) -> None:
        """The decode peer or the transfer engine does something to one room."""
        sender, action = data.draw(st.sampled_from(self._backend_moves()), label="move")
        sender.act(action)

    @precondition(lambda self: isinstance(getattr(self, "runner", None), PageEchoRunner))
    @rule()
    def forward_fault(self) -> None:
        """The next forward raises (a device error): its requests fail, nothing leaks."""
        assert isinstance(self.runner, PageEchoRunner)
        self.runner.fail_next = True

    @precondition(lambda self: self.sched is not None)
    @rule(dt=st.sampled_from([0.001, 0.5, 5.0, 10.0]))
    def tick(self, dt: float) -> None:
        """Time passes (the deadlines are 10 s)."""
        self.clock.now += dt

    # -- invariants -------------------------------------------------------------------------

    def _track(self) -> None:
        assert self.sched is not None
        for req in self.sched.lifecycle.live():
            self.seen.setdefault(id(req), req)

    @invariant()
    def check_everything(self) -> None:
        sched = self.sched
        if sched is None:
            return
        self._track()
        sched.check_invariants()  # conservation of pages and slots; the state index
        self._check_requests(sched)
        self._check_pages(sched)
        self._check_responses()

    def _check_requests(self, sched: PrefillScheduler) -> None:
        live = {r.rid: r for r in sched.lifecycle.live()}
        for key, req in list(self.seen.items()):
            assert timeline_violations(req, PREFILL_TABLE) == [], req
            assert resource_violations(req) == [], resource_violations(req)
            if req.is_final:
                assert live.get(req.rid) is not req and req.on_device == 0, req
                # Final states are absorbing (checked above); a finished request is checked
                # once more through its response, not on every later step.
                del self.seen[key]
                continue
            assert req.state is not None and live[req.rid] is req
            assert sched.lifecycle.in_state(req.state)[req.rid] is req
            if req.on_device:
                assert req.state is S.FORWARD and sched.overlap, req
        slots = [r.slot for r in live.values() if r.slot is not None]
        assert len(slots) == len(set(slots)), f"a metadata slot is held twice: {sorted(slots)}"

    def _check_pages(self, sched: PrefillScheduler) -> None:
        held = set(self.pool.allocator.held_pages())
        owned: list[int] = [p for r in sched.lifecycle.live() for p in r.pages]
        assert len(owned) == len(set(owned)), "a page is held by two live requests"
        assert set(owned) <= held, f"live requests hold free pages {set(owned) - held}"
        read = {p for s in self.scripted.senders for p in s.reading}
        assert read <= held, f"pages {sorted(read - held)} are free while a transfer reads them"
        violations = getattr(self.runner, "violations", []) + self.scripted.violations
        assert not violations, violations

    def _check_responses(self) -> None:
        answered = collections.Counter(r.rid for r in self.responses)
        for rid, n in answered.items():
            assert n <= self.submitted[rid], f"{rid!r} answered {n} times, submitted " \
                                             f"{self.submitted[rid]}"
        for resp in self.responses[self._checked:]:
            self._check_response(resp)
        self._checked = len(self.responses)

    def _check_response(self, resp: Response) -> None:
        assert resp.state in (S.DONE, S.FAILED), resp
        assert (resp.state is S.DONE) == (resp.reason is None), resp
        never_fits = resp.prompt_tokens == 0 or pages_needed(
            resp.prompt_tokens, self.config.page_size) > self.pool.num_pages
        if never_fits:
            assert resp.reason is FailureReason.REJECTED, resp
        if resp.timeline:
            replay = PrefillRequest(resp.rid, state=resp.state, timeline=list(resp.timeline))
            assert timeline_violations(replay, PREFILL_TABLE) == [], resp
        else:  # refused before admission: only a duplicate id
            assert resp.reason is FailureReason.REJECTED and "already live" in resp.detail, resp
        reference = self.setup.reference
        if resp.ok and reference is not None:
            want = reference(prompt_of(resp.rid, resp.prompt_tokens))
            assert resp.first_token == want, f"{resp.rid}: first token {resp.first_token} != {want}"

    def _check_deadlines(self) -> None:
        """Invariant 5 after a pass: nothing live is past its state's deadline."""
        assert self.sched is not None
        now, cfg = self.clock.now, self.config
        for req in self.sched.lifecycle.live():
            if req.state is S.BOOTSTRAPPING:
                assert now < req.timeline[0][0] + cfg.bootstrap_timeout, req
            elif req.state is S.TRANSFERRING:
                assert now < _entered(req, "prefilled") + cfg.transfer_timeout, req


def _entered(req: PrefillRequest, event: str) -> float:
    return next(t for t, e in reversed(req.timeline) if e == event)


def scheduler_machine(
    *,
    config: SchedulerConfig | None = None,
    runner_factory: RunnerFactory | None = None,
    reference: Reference | None = None,
    pages: int | None = None,
    slots: int | None = None,
    loop: str = "both",
    faults: FaultPlan | None = None,
) -> type[SchedulerMachine]:
    """A :class:`SchedulerMachine` subclass for one configuration; use its ``.TestCase``.

    ``config`` None draws small budgets per example (:func:`scheduler_configs`).
    ``runner_factory(num_pages, page_size)`` builds the model runner and, through
    ``runner.pool``, the KV pool (default: :class:`PageEchoRunner`); ``reference(prompt)``
    is the first token a DONE request must report (default: the echo's; None skips the check
    for a runner given without one). ``pages``/``slots`` None draw small pools. ``loop`` is
    ``normal``, ``overlap`` or ``both`` (drawn). ``faults`` is the fault plan of the fake host's
    requests.
    """
    if runner_factory is not None and reference is None:
        check: Reference | None = None
    else:
        check = reference or echo_next_token
    fields: dict[str, Any] = dict(
        config=config, runner_factory=runner_factory or echo_runner_factory, reference=check,
        pages=pages, slots=slots, loop=loop,
    )
    if faults is not None:
        fields["faults"] = faults
    setup = MachineSetup(**fields)
    return type(f"SchedulerMachine_{loop}", (SchedulerMachine,), {"setup": setup})


def iter_loops(loop: str) -> Iterator[str]:
    """The loops ``loop`` names: ``both`` is normal then overlap."""
    yield from (("normal", "overlap") if loop == "both" else (loop,))
