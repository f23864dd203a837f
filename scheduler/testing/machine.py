"""Property-based testing of the whole prefill scheduler: a Hypothesis stateful machine.

``lifecycle.testing`` fuzzes lifecycle *tables* (one :class:`~lifecycle.Lifecycle`, events
fired by hand). This module fuzzes the *scheduler*: a real
:class:`~scheduler.prefill.PrefillScheduler` with a real model runner (or any
:class:`~scheduler.runner.ModelRunner`) and a transfer backend whose every move the test
decides. It lives in ``scheduler/`` because ``lifecycle/`` may not import upward. An embedder
points it at their own configuration with :func:`scheduler_machine` (``docs/fuzzing.md``).

Theory of operation
-------------------
The scheduler is driven only through its public surface (``submit``, ``abort``, ``step``) and
its boundaries: the injected clock (:class:`~lifecycle.testing.FakeClock`), the model runner,
the device of the overlap loop, and the KV managers. Requests go to one of two managers:
:class:`ScriptedKVManager`, whose senders change state only when a rule says so (handshake,
bootstrap failure or timeout, transfer failure, the engine finishing its reads, success), and
the seeded :class:`~kv.fake.FakeKVManager` on the fake host ``2.2.2.2`` with a
:class:`~kv.fake.FaultPlan`. A scripted sender keeps reading the pages it was sent until a rule
drains it, so aborts and failures land while pages are being transferred; under the overlap loop
a batch stays on the device between passes, so aborts land while a forward may write pages.

Determinism: the machine controls time on the device as it controls the clock. Under the
overlap loop forwards run on a :class:`~scheduler.testing.device.SteppedDevice`, not a thread: a
forward runs when the ``device_finishes`` rule says so, or when the next pass waits for its
result. No thread runs beside the rules, so which rules are enabled and every value drawn
depend only on the choices drawn before. Preconditions and the lists rules draw from read only
the machine's own model (:class:`Observed`, taken after every rule). The production overlap
loop keeps its device thread; ``tests/test_scheduler_device_stress.py`` runs that thread under
load.

After every rule the machine checks invariants 1 to 5 of ``docs/architecture.md``
(:mod:`.checks`; invariant 6, ranks agreeing, is covered by the TP tests); at teardown it drives
the scheduler to quiescence and asserts every pool is full again and every sender was cleared.
A broken check raises :class:`~scheduler.testing.verdicts.InvariantViolation` naming the
invariant; an exception out of the scheduler is wrapped as
:class:`~scheduler.testing.verdicts.CodeUnderTestError`, and a forward of the runner that
raised or answered its batch wrongly (which the scheduler survives, failing the batch) is
reported as one too; anything else is the machine's own error
(:func:`~scheduler.testing.verdicts.classify`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from hypothesis.stateful import invariant as invariant_rule

from kv.fake import FakeKVManager, FaultPlan
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from kv.state_pools import StatePools
from lifecycle import FailureReason, PrefillRequest, PrefillState
from lifecycle.testing import FakeClock
from scheduler.messages import FAKE_BOOTSTRAP_HOST, NewRequest, Response
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.testing.checks import (
    check_aborts,
    check_all_answered,
    check_all_free,
    check_answer_counts,
    check_deadlines,
    check_pages,
    check_requests,
    check_response,
)
from scheduler.testing.device import SteppedDevice
from scheduler.testing.fakes import (
    DECODE_HOST,
    Reference,
    RunnerFactory,
    ScriptedKVManager,
    ScriptedSender,
    echo_next_token,
    echo_runner_factory,
)
from scheduler.testing.guard import GuardedRunner
from scheduler.testing.prefix import check_prefix_cache, drain_prefix_cache
from scheduler.testing.setup import (
    MachineSetup,
    prompt_of,
    scheduler_configs,
)
from scheduler.testing.verdicts import CodeUnderTestError, invariant, under_test

S = PrefillState
T = TypeVar("T")

_QUIESCE_PASSES = 200


# -- the machine -----------------------------------------------------------------------------


@attrs.frozen
class Observed:
    """The machine's own model of what rules can do next, taken after every rule. Preconditions
    and the choices rules draw from read only this, never the scheduler or a fake directly."""

    live: tuple[str, ...] = ()  # ids of live requests, sorted
    moves: tuple[tuple[ScriptedSender, str], ...] = ()  # backend moves possible now
    device_busy: bool = False  # a forward waits on the stepped device


class SchedulerMachine(RuleBasedStateMachine):
    """See the module docstring. Use :func:`scheduler_machine` to configure one."""

    setup: ClassVar[MachineSetup] = MachineSetup()

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.sched: PrefillScheduler | None = None
        self.device: SteppedDevice | None = None
        self.observed = Observed()
        self.program: list[str] = []  # every rule and every value drawn, then the answers
        self.responses: list[Response] = []
        self.submitted: collections.Counter[str] = collections.Counter()
        # Request objects seen live and not yet checked in a final state, by id.
        self.seen: dict[int, PrefillRequest] = {}
        self.rooms: dict[str, list[int]] = {DECODE_HOST: [], FAKE_BOOTSTRAP_HOST: []}
        self.serial = 0
        # Aborts of live requests since the last pass, with the failure each already had.
        self._aborted: list[tuple[PrefillRequest, FailureReason | None]] = []
        self._checked = 0  # responses checked so far
        # The last rule and the checks after it completed: False once something raised, so
        # teardown does not pile a second failure on the first.
        self._settled = False

    def _begin(self, rule: str) -> None:
        """A rule starts: note it; the example counts as settled again only once the checks
        after it pass."""
        self.program.append(rule)
        self._settled = False

    def _draw(self, data: st.DataObject, strategy: st.SearchStrategy[T], label: str) -> T:
        value = data.draw(strategy, label=label)
        self.program.append(f"  {label}={value!r}")
        return value

    def _observe(self) -> None:
        sched = self.sched
        if sched is None:
            return
        self.observed = Observed(
            live=tuple(sorted(r.rid for r in sched.lifecycle.live())),
            moves=tuple((s, a) for s in self.scripted.senders for a in s.actions()),
            device_busy=self.device is not None and self.device.busy,
        )

    # -- building ---------------------------------------------------------------------------

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        s = self.setup
        self._begin("build")
        config = s.config or self._draw(data, scheduler_configs(), "config")
        ps = config.page_size
        self.pages = s.pages or self._draw(data, st.integers(2, 24), "pages")
        num_slots = s.slots or self._draw(data, st.integers(1, 4), "slots")
        overlap = {"normal": False, "overlap": True}.get(s.loop)
        if overlap is None:
            overlap = self._draw(data, st.booleans(), "overlap")
        with under_test("the runner factory"):
            runner = s.runner_factory(self.pages, ps)
        self.runner = GuardedRunner(runner)
        self.pool = self.runner.pool
        # Prompts are drawn within the runner's vocabulary: outside it they would be refused.
        self.vocab_size: int | None = getattr(runner, "vocab_size", None)
        self.capacity = self.pool.num_pages * ps
        self.states = None if s.states is None else s.states(self.pool)
        if self.states is not None:
            config = attrs.evolve(config, radix_cache=False, schedule_policy="fcfs")
        self.scripted = ScriptedKVManager(self.pool, self.states)
        self.fake = FakeKVManager(s.faults, clock=self.clock)
        self.config = config
        self.device = SteppedDevice() if overlap else None
        with under_test("PrefillScheduler()"):  # the runner's pool as the config wants it
            self.sched = PrefillScheduler(
                config=config, runner=self.runner, kv=self.scripted, fake_kv=self.fake,
                metadata=MetadataBuffers(num_slots), slots=SlotAllocator(num_slots),
                clock=self.clock, on_response=self.responses.append, overlap=overlap,
                device=self.device, states=self.states,
            )
        self._observe()

    def teardown(self) -> None:
        sched = self.sched
        if sched is None:
            return
        if not self._settled:
            # The example already failed (a rule or a check raised): that is the report. The
            # scheduler's state may be anything now; close it, and never mask the failure.
            with contextlib.suppress(Exception):
                sched.close()
            return
        try:
            self._quiesce(sched)
        except BaseException:
            # Quiescing failed: that is the report; close() after it must not mask it (the
            # overlap loop's close lands the batch in flight, which fails the same way).
            with contextlib.suppress(Exception):
                sched.close()
            raise
        with under_test("close()"):
            sched.close()
        self.program += [f"answer {r.rid} {r.state.name} {r.reason} {r.first_token}"
                         for r in self.responses]
        if self.setup.on_program is not None:
            self.setup.on_program(tuple(self.program))

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
            with under_test("step()"):
                worked = sched.step()
            resting = 0 if worked else resting + 1
            self.clock.now += 0.5 if resting < 3 else max(self.config.bootstrap_timeout,
                                                          self.config.transfer_timeout)
            self.check_everything()
        check_all_answered(sched, self.responses, self.submitted, _QUIESCE_PASSES)
        drain_prefix_cache(sched)  # nothing locked; then the tree's pages go back too
        check_all_free(sched, self.scripted)

    # -- rules ------------------------------------------------------------------------------

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data(), n=st.integers(1, 3))
    def submit(self, data: st.DataObject, n: int) -> None:
        """New requests: any length (empty and too long too), fresh or reused rooms and ids,
        to the scripted peer or the fake host."""
        assert self.sched is not None
        self._begin(f"submit n={n}")
        for _ in range(n):
            rid = self._draw_rid(data)
            cap = self.capacity
            length = self._draw(data, st.one_of(
                st.integers(1, 3 * self.config.page_size), st.integers(1, cap),
                st.sampled_from([0, cap, cap + 1]),
            ), "length")
            host = self._draw(data, st.sampled_from([DECODE_HOST] * 3 + [FAKE_BOOTSTRAP_HOST]),
                              "host")
            used = self.rooms[host]
            self.serial += 1
            room = 1000 + self.serial
            if bool(used) and self._draw(data, st.booleans(), "reuse room"):
                room = self._draw(data, st.sampled_from(used), "reused room")
            used.append(room)
            self.submitted[rid] += 1
            with under_test("submit()"):
                self.sched.submit(NewRequest(
                    rid, prompt_of(rid, length, self.vocab_size), bootstrap_host=host,
                    bootstrap_port=1, bootstrap_room=room))

    def _draw_rid(self, data: st.DataObject) -> str:
        if self.submitted and self._draw(data, st.integers(0, 5), "reuse rid") == 0:
            return self._draw(data, st.sampled_from(sorted(self.submitted)), "rid")
        return f"r{len(self.submitted) + 1}"

    @precondition(lambda self: self.sched is not None)
    @rule()
    def step(self) -> None:
        """One pass; then the per-pass checks (deadlines, aborts took effect)."""
        assert self.sched is not None
        self._begin("step")
        pending = list(self._aborted)
        self._aborted.clear()
        with under_test("step()"):
            self.sched.step()
        self._track()
        check_deadlines(self.sched, self.clock.now)
        check_aborts(pending)

    @precondition(lambda self: self.sched is not None and bool(self.submitted))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Abort a live request (in any state, also on the device or mid-transfer), a
        finished one, or one never seen."""
        assert self.sched is not None
        self._begin("abort")
        live = self.observed.live
        choice = self._draw(data, st.sampled_from(["live"] * 3 + ["any", "unknown"]), "target")
        if choice == "live" and live:
            rid = self._draw(data, st.sampled_from(live), "victim")
            req = self.sched.lifecycle.get(rid)
            assert req is not None, f"the machine's model says {rid!r} is live"
            self._aborted.append((req, req.pending_abort))
        elif choice == "unknown":
            rid = "never-submitted"
        else:
            rid = self._draw(data, st.sampled_from(sorted(self.submitted)), "rid")
        with under_test("abort()"):
            self.sched.abort(rid)

    @precondition(lambda self: bool(self.observed.moves))
    @rule(data=st.data())
    def backend(self, data: st.DataObject) -> None:
        """The decode peer or the transfer engine does something to one room."""
        self._begin("backend")
        sender, action = self._draw(data, st.sampled_from(self.observed.moves), "move")
        sender.act(action)

    @precondition(lambda self: self.observed.device_busy)
    @rule()
    def device_finishes(self) -> None:
        """The device finishes the oldest forward it holds (overlap loop): the scheduler finds
        the result ready at its next pass, instead of waiting for it there."""
        assert self.device is not None
        self._begin("device_finishes")
        self.program.append(f"  ran={self.device.finish_next()!r}")

    @precondition(lambda self: getattr(self, "runner", None) is not None)
    @rule()
    def forward_fault(self) -> None:
        """The next forward raises (a device error), whatever the runner: its requests fail,
        nothing leaks."""
        assert isinstance(self.runner, GuardedRunner)
        self._begin("forward_fault")
        self.runner.fail_next = True

    @precondition(lambda self: self.sched is not None)
    @rule(dt=st.sampled_from([0.001, 0.5, 5.0, 10.0]))
    def tick(self, dt: float) -> None:
        """Time passes (the deadlines are 10 s)."""
        self._begin(f"tick dt={dt}")
        self.clock.now += dt

    # -- invariants -------------------------------------------------------------------------

    def _track(self) -> None:
        assert self.sched is not None
        for req in self.sched.lifecycle.live():
            self.seen.setdefault(id(req), req)

    @invariant_rule()
    def check_everything(self) -> None:
        sched = self.sched
        if sched is None:
            return
        self._track()
        faults = self.runner.faults
        if faults:  # the scheduler failed the batch and went on: the runner is at fault
            raise CodeUnderTestError(faults[0])
        with invariant(4):
            sched.lifecycle.check_index()
        check_prefix_cache(sched)  # before check_invariants(), which checks it too
        with invariant(3):
            sched.check_invariants()  # conservation of pages and slots
        check_pages(sched, self.scripted, self.runner)
        check_requests(sched, self.seen)
        check_answer_counts(self.responses, self.submitted)
        for resp in self.responses[self._checked:]:
            check_response(resp, self.pool, self.setup.reference, self.vocab_size)
        self._checked = len(self.responses)
        self._observe()
        self._settled = True


def scheduler_machine(
    *,
    config: SchedulerConfig | None = None,
    runner_factory: RunnerFactory | None = None,
    reference: Reference | None = None,
    pages: int | None = None,
    slots: int | None = None,
    loop: str = "both",
    faults: FaultPlan | None = None,
    on_program: Callable[[tuple[str, ...]], None] | None = None,
    states: Callable[[KVPool], StatePools] | None = None,
) -> type[SchedulerMachine]:
    """A :class:`SchedulerMachine` subclass for one configuration; use its ``.TestCase``.

    ``config`` None draws small budgets per example (:func:`scheduler_configs`).
    ``runner_factory(num_pages, page_size)`` builds the model runner and, through
    ``runner.pool``, the KV pool (default: :class:`PageEchoRunner`); ``reference(prompt)``
    is the first token a DONE request must report (default: the echo's; None skips the check
    for a runner given without one). ``pages``/``slots`` None draw small pools. ``loop`` is
    ``normal``, ``overlap`` or ``both`` (drawn). ``faults`` is the fault plan of the fake host's
    requests. ``on_program`` is called at the end of every example with the program it ran
    (every rule, every value drawn, then the answers), e.g. to compare two searches.
    ``states(pool)`` builds state pools beside the runner's pool (``kv/state_pools.py``); the
    prefix cache is off then.
    """
    if runner_factory is not None and reference is None:
        check: Reference | None = None
    else:
        check = reference or echo_next_token
    fields: dict[str, Any] = dict(
        config=config, runner_factory=runner_factory or echo_runner_factory, reference=check,
        pages=pages, slots=slots, loop=loop, on_program=on_program, states=states,
    )
    if faults is not None:
        fields["faults"] = faults
    setup = MachineSetup(**fields)
    return type(f"SchedulerMachine_{loop}", (SchedulerMachine,), {"setup": setup})
