"""The prefill scheduler pass, walked step by step on the fake backend with the tiny model."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kv.fake import FakeKVManager, FaultPlan
from kv.metadata import MetadataBuffers, SlotAllocator
from lifecycle import FailureReason, PrefillState, SamplingParams
from lifecycle.testing import FakeClock
from scheduler.messages import NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch
from scheduler.stepping import OneThread, step_until
from scheduler.testing.device import SteppedDevice

S = PrefillState
MODEL = LlamaModel(ModelConfig.tiny(seed=3))
REFERENCE = ReferenceModel(MODEL)


class Harness:
    def __init__(
        self,
        faults: FaultPlan | None = None,
        *,
        pages: int = 64,
        slots: int = 4,
        overlap: bool = False,
        runner: object | None = None,
        device: SteppedDevice | None = None,
        **config: object,
    ) -> None:
        self.clock = FakeClock()
        self.responses: list[Response] = []
        self.pool = MODEL.make_pool(num_pages=pages, page_size=4)
        self.kv = FakeKVManager(faults, clock=self.clock)
        defaults: dict[str, object] = dict(page_size=4, chunked_prefill_size=8,
                                           check_invariants=True)
        defaults.update(config)
        self.sched = PrefillScheduler(
            config=SchedulerConfig(**defaults),  # type: ignore[arg-type]
            runner=runner or PagedModelRunner(MODEL, self.pool),  # type: ignore[arg-type]
            kv=self.kv,
            metadata=MetadataBuffers(slots),
            slots=SlotAllocator(slots),
            clock=self.clock,
            on_response=self.responses.append,
            overlap=overlap,
            device=device,
        )
        self.rooms = 0

    def submit(self, rid: str, n: int) -> None:
        self.rooms += 1
        self.sched.submit(
            NewRequest(rid, tuple((7 * i + len(rid)) % 256 for i in range(n)),
                       bootstrap_host="decode", bootstrap_port=1, bootstrap_room=self.rooms)
        )

    def step(self) -> None:
        self.sched.step()
        self.sched.check_invariants()

    def states(self) -> dict[str, PrefillState]:
        return {r.rid: r.state for r in self.sched.lifecycle.live()}  # type: ignore[misc]

    def answered(self) -> dict[str, tuple[PrefillState, FailureReason | None]]:
        return {r.rid: (r.state, r.reason) for r in self.responses}

    def assert_empty(self) -> None:
        assert self.sched.idle()
        assert self.pool.allocator.available() == self.pool.num_pages
        assert self.sched.slots.available() == self.sched.slots.num_slots


def test_a_chunked_request_walks_every_state():
    h = Harness(FaultPlan(handshake_delay_s=1.0, transfer_delay_s=1.0))
    h.submit("a", 18)  # chunks of 8, 8, 2 tokens (page size 4)
    h.step()
    req = h.sched.lifecycle.get("a")
    assert req is not None
    assert h.states() == {"a": S.BOOTSTRAPPING}
    assert (req.pages, req.slot, req.deadline) == ([], None, 300.0)
    h.step()
    assert h.states() == {"a": S.BOOTSTRAPPING}  # the handshake has not arrived yet
    h.clock.now = 1.0
    h.step()  # handshake → slot → WAITING → schedule → first chunk computed
    assert h.states() == {"a": S.FORWARD}
    assert (req.computed, req.sent, len(req.pages), req.slot) == (8, 8, 2, 0)
    assert req.sender.sent_pages == 2  # type: ignore[attr-defined]
    h.step()
    assert (req.state, req.computed, req.sent, len(req.pages)) == (S.FORWARD, 16, 16, 4)
    h.step()
    assert (req.state, req.computed, req.sent, len(req.pages)) == (S.TRANSFERRING, 18, 18, 5)
    assert req.sender.sent_pages == 5  # type: ignore[attr-defined]
    assert req.first_token == REFERENCE.generate(list(req.input_ids), 1)[0]
    assert h.responses == []
    h.clock.now = 2.0
    h.step()
    assert h.states() == {}
    assert h.answered() == {"a": (S.DONE, None)}
    assert h.responses[0].first_token == req.first_token
    assert [e for _, e in req.timeline] == [
        "admitted", "bootstrapped", "schedule", "chunk_done", "chunk_done", "prefilled",
        "transferred",
    ]
    h.assert_empty()


def test_a_chunked_prompt_gets_one_run_of_pages_where_it_fits():
    h = Harness()
    alloc = h.pool.allocator
    held = alloc.alloc(64)
    assert held is not None
    alloc.free([0, 1, *range(10, 18)])  # free runs of 2 and 8 pages
    h.submit("a", 18)  # 5 pages, in chunks of 2, 2 and 1 page
    h.sched.step()  # (the pages held above are no request's: no invariant checks here)
    req = h.sched.lifecycle.get("a")
    assert req is not None
    for _ in range(10):
        if req.state is S.TRANSFERRING:
            break
        h.sched.step()
    # The first chunk alone fits pages 0-1, but the whole prompt only fits from page 10.
    assert req.state is S.TRANSFERRING and req.pages == [10, 11, 12, 13, 14]


def test_a_pass_that_only_polls_a_held_back_sender_is_not_work():
    """A loop rests between passes that did no work; polling a sender whose transfer is still
    held back by a delay changes nothing, so it must not keep the loop spinning."""
    h = Harness(FaultPlan(transfer_delay_s=1.0))
    h.submit("a", 4)
    h.sched.run_until(lambda: h.states().get("a") is S.TRANSFERRING)
    assert [h.sched.step() for _ in range(3)] == [False, False, False]
    assert h.states() == {"a": S.TRANSFERRING}
    h.clock.now += 1.0
    assert h.sched.step()  # the transfer concluded
    assert h.answered() == {"a": (S.DONE, None)}


def test_no_free_metadata_slot_means_wait_not_fail():
    h = Harness(FaultPlan(transfer_delay_s=1.0), slots=2)
    for i in range(4):
        h.submit(f"r{i}", 4)
    h.step()
    assert h.states() == {
        "r0": S.TRANSFERRING, "r1": S.TRANSFERRING, "r2": S.BOOTSTRAPPING, "r3": S.BOOTSTRAPPING
    }
    h.clock.now = 1.0
    h.step()  # r0, r1 done; their slots let r2, r3 through
    assert h.states() == {"r2": S.TRANSFERRING, "r3": S.TRANSFERRING}
    h.clock.now = 2.0
    h.step()
    assert h.answered() == {f"r{i}": (S.DONE, None) for i in range(4)}
    h.assert_empty()


def test_prompts_that_can_never_fit_are_rejected_at_once():
    h = Harness(pages=8)
    h.submit("long", 8 * 4 + 1)
    h.submit("empty", 0)
    h.submit("fits", 8 * 4)
    h.step()
    answered = h.answered()
    assert answered["long"] == (S.FAILED, FailureReason.REJECTED)
    assert answered["empty"] == (S.FAILED, FailureReason.REJECTED)
    by_rid = {r.rid: r for r in h.responses}
    assert by_rid["long"].http_status == 400
    assert "33 tokens" in by_rid["long"].detail
    h.sched.run_until(lambda: "fits" in h.answered())
    assert h.answered()["fits"] == (S.DONE, None)
    h.assert_empty()


def test_bootstrap_timeout_on_the_injected_clock():
    h = Harness(FaultPlan(bootstrap_timeout=1.0), bootstrap_timeout=5.0)
    h.submit("a", 4)
    h.step()
    h.clock.now = 4.9
    h.step()
    assert h.states() == {"a": S.BOOTSTRAPPING}
    h.clock.now = 5.0
    h.step()
    assert h.answered() == {"a": (S.FAILED, FailureReason.BOOTSTRAP_TIMEOUT)}
    assert h.responses[0].http_status == 500
    h.assert_empty()


def test_transfer_timeout_on_the_injected_clock():
    h = Harness(FaultPlan(transfer_delay_s=1000.0), transfer_timeout=10.0)
    h.submit("a", 4)
    h.step()
    assert h.states() == {"a": S.TRANSFERRING}
    h.clock.now = 10.0
    h.step()
    assert h.answered() == {"a": (S.FAILED, FailureReason.TRANSFER_TIMEOUT)}
    h.assert_empty()


def test_injected_bootstrap_and_transfer_failures():
    h = Harness(FaultPlan(seed=2, bootstrap_failure=0.3, transfer_failure=0.3), slots=8,
                pages=256)
    for i in range(30):
        h.submit(f"r{i}", 3 + i)
    h.sched.run_until(lambda: len(h.responses) == 30)
    reasons = {reason for _, reason in h.answered().values()}
    assert reasons == {None, FailureReason.BOOTSTRAP_FAILED, FailureReason.TRANSFER_FAILED}
    assert len({r.rid for r in h.responses}) == 30  # exactly one answer each
    h.assert_empty()


def test_abort_while_bootstrapping_waiting_between_chunks_and_transferring():
    h = Harness(FaultPlan(handshake_delay_s=1.0, transfer_delay_s=5.0),
                max_running_requests=2)
    h.submit("boot", 4)
    h.step()
    h.sched.abort("boot")
    h.step()
    assert h.answered() == {"boot": (S.FAILED, FailureReason.ABORTED)}

    h.submit("xfer", 4)
    h.submit("chunked", 40)
    h.submit("waiting", 4)
    h.step()
    h.clock.now = 1.0
    h.step()
    # max_running_requests=2: "waiting" stays in WAITING behind the other two.
    assert h.states() == {"xfer": S.TRANSFERRING, "chunked": S.FORWARD, "waiting": S.WAITING}
    for rid in ("xfer", "chunked", "waiting"):
        h.sched.abort(rid)
    h.step()
    assert h.states() == {}
    assert {rid: a for rid, a in h.answered().items()} == {
        rid: (S.FAILED, FailureReason.ABORTED) for rid in ("boot", "xfer", "chunked", "waiting")
    }
    assert h.responses[0].http_status == 200
    h.assert_empty()


def test_abort_of_unknown_or_finished_requests_changes_nothing():
    h = Harness()
    h.submit("a", 4)
    h.sched.run_until(lambda: len(h.responses) == 1)
    h.sched.abort("a")
    h.sched.abort("nobody")
    h.step()
    assert h.answered() == {"a": (S.DONE, None)}
    h.assert_empty()


def test_duplicate_ids_and_live_rooms_are_refused():
    h = Harness(FaultPlan(transfer_delay_s=1.0))
    h.submit("a", 4)
    h.step()
    h.sched.submit(NewRequest("a", (1, 2), bootstrap_host="decode", bootstrap_room=99))
    h.sched.submit(NewRequest("b", (1, 2), bootstrap_host="decode", bootstrap_room=1))
    h.step()
    assert [(r.rid, r.reason) for r in h.responses] == [
        ("a", FailureReason.REJECTED), ("b", FailureReason.REJECTED)
    ]
    assert "room 1 is in use" in h.responses[1].detail
    assert h.states() == {"a": S.TRANSFERRING}
    h.clock.now = 1.0
    h.step()
    # Once concluded, the room may be used again.
    h.sched.submit(NewRequest("c", (1, 2), bootstrap_host="decode", bootstrap_room=1))
    h.step()
    h.clock.now = 2.0
    h.sched.run_until(lambda: len(h.responses) == 4)
    assert h.answered()["c"] == (S.DONE, None)
    h.assert_empty()


def wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.001)


class GatedRunner:
    """The model runner, held on the device until the test opens the gate."""

    def __init__(self, pool) -> None:
        self.inner = PagedModelRunner(MODEL, pool)
        self.pool = pool
        self.gate = threading.Event()
        self.entered = threading.Event()

    def forward(self, batch: ForwardBatch) -> list[int]:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.forward(batch)


def test_abort_while_the_batch_is_on_the_device_waits_for_its_result():
    pool = MODEL.make_pool(num_pages=64, page_size=4)
    runner = GatedRunner(pool)
    h = Harness(overlap=True, runner=runner)
    h.pool = pool
    h.sched.pool = pool
    h.submit("a", 12)
    h.step()  # launched on the device worker; blocked there
    assert runner.entered.wait(10)
    req = h.sched.lifecycle.get("a")
    assert req is not None and req.on_device == 1 and len(req.pages) == 2
    h.sched.abort("a")
    # The next pass records the abort, then waits on the device for the batch's result.
    stepper = threading.Thread(target=h.sched.step)
    stepper.start()
    wait_for(lambda: req.pending_abort is FailureReason.ABORTED)
    assert req.state is S.FORWARD  # not applied: the forward may still write the pages
    assert pool.allocator.available() == 64 - 2
    runner.gate.set()
    stepper.join(30)
    h.sched.run_until(lambda: len(h.responses) == 1)
    assert h.answered() == {"a": (S.FAILED, FailureReason.ABORTED)}
    assert [e for _, e in req.timeline] == ["admitted", "bootstrapped", "schedule", "abort"]
    h.sched.close()
    h.assert_empty()


def test_the_overlap_loop_runs_forwards_on_the_device_it_is_given():
    device = SteppedDevice()
    h = Harness(overlap=True, device=device)
    h.submit("a", 12)
    h.step()  # launched: the forward waits on the device
    req = h.sched.lifecycle.get("a")
    assert req is not None and req.on_device == 1 and device.busy and device.finished == 0
    h.sched.abort("a")
    h.step()  # the abort is deferred; landing the batch runs its forward, then settles it
    assert device.finished == 1 and not device.busy
    assert h.answered() == {"a": (S.FAILED, FailureReason.ABORTED)}
    assert [e for _, e in req.timeline] == ["admitted", "bootstrapped", "schedule", "abort"]
    h.sched.close()
    assert device.closed
    h.assert_empty()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_closed_scheduler_takes_no_requests_and_runs_no_passes(overlap: bool) -> None:
    """A submit after close() was served (normal loop), and a step after it raised out of the
    device worker's executor and stranded pages (overlap loop)."""
    h = Harness(overlap=overlap, device=SteppedDevice() if overlap else None)
    h.submit("a", 6)
    while h.answered() != {"a": (S.DONE, None)}:
        h.step()
    h.sched.close()
    h.sched.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="this PrefillScheduler is closed: it takes no more"):
        h.submit("b", 6)
    with pytest.raises(RuntimeError, match="this PrefillScheduler is closed: it runs no more"):
        h.sched.step()
    assert h.sched.lifecycle.get("b") is None
    h.assert_empty()


def test_a_device_needs_the_overlap_loop():
    with pytest.raises(ValueError, match="only the overlap loop"):
        Harness(device=SteppedDevice())


@pytest.mark.parametrize("overlap", [False, True])
def test_first_tokens_match_the_colocated_reference(overlap):
    h = Harness(pages=512, slots=8, overlap=overlap, chunked_prefill_size=16)
    lengths = [1, 3, 4, 5, 16, 17, 63, 200]
    for i, n in enumerate(lengths):
        h.submit(f"r{i}", n)
    h.sched.run_until(lambda: len(h.responses) == len(lengths))
    h.sched.close()
    for r in h.responses:
        prompt = [(7 * i + len(r.rid)) % 256 for i in range(r.prompt_tokens)]
        assert r.ok and r.first_token == REFERENCE.generate(prompt, 1)[0], r.rid
    h.assert_empty()


def test_metrics_count_what_happened():
    h = Harness(FaultPlan(seed=1, transfer_failure=1.0))
    h.submit("a", 4)
    h.sched.run_until(lambda: len(h.responses) == 1)
    reg = h.sched.metrics.registry
    assert reg.get_sample_value(
        "pdlife_requests_finished_total", {"state": "failed", "reason": "transfer_failed"}
    ) == 1
    assert reg.get_sample_value("pdlife_prefill_tokens_total") == 4
    assert reg.get_sample_value("pdlife_kv_pages_used") == 0
    assert reg.get_sample_value("pdlife_requests", {"state": "transferring"}) == 0
    # The lifecycle's own counts, read when scraped: a -> WAITING -> FORWARD -> TRANSFERRING,
    # where the transfer failed; every event of the table is listed, 0 if never fired.
    fired = {e: reg.get_sample_value("pdlife_transitions_total", {"event": e})
             for e in ("bootstrapped", "schedule", "prefilled", "fail", "transferred", "abort")}
    assert fired == {"bootstrapped": 1, "schedule": 1, "prefilled": 1, "fail": 1,
                     "transferred": 0, "abort": 0}
    # A request with a decode peer is no probe.
    assert reg.get_sample_value("pdlife_probe_bootstraps_total") == 0
    assert h.sched.lifecycle.transitions_fired == 4


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="a stop string must not be empty"):
        SamplingParams(stop=("ok", ""))
    with pytest.raises(ValueError, match="stop_token_ids must be >= 0, got -1"):
        SamplingParams(stop_token_ids=(3, -1))
    # One string is one stop string (it was split into its characters).
    assert SamplingParams(stop="Paris").stop == ("Paris",)
    assert SamplingParams(stop=["Paris", "Rome"]).stop == ("Paris", "Rome")
    with pytest.raises(ValueError, match="stop must be a string or strings, got 123"):
        SamplingParams(stop=123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop must be a string or strings"):
        SamplingParams(stop=["ok", 5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        SchedulerConfig(page_size=16, chunked_prefill_size=8)
    assert SamplingParams(stop=None).stop == ()  # OpenAI's null: no stop strings


@pytest.mark.parametrize(("fields", "says"), [
    ({"max_new_tokens": "8"}, "max_new_tokens must be an integer, got '8' (str)"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True (bool)"),
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5' (str)"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1 (int)"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5 (float)"),
    ({"grammar": {"type": "object"}}, "grammar must be a GrammarSpec, got {'type': 'object'}"),
    ({"stop_token_ids": 5}, "token ids must be a sequence of integers, got 5"),
    ({"stop_token_ids": [1, "2"]}, "token ids must be integers, got '2' (str)"),
    ({"min_new_tokens": "1"}, "min_new_tokens must be an integer, got '1' (str)"),
])
def test_sampling_params_refuse_a_wrong_type_where_they_are_built(
        fields: dict[str, object], says: str) -> None:
    """A wrong type failed much later, in the engine's pass (a TypeError comparing an int with
    a string ended an embedded pair's loop for every request)."""
    with pytest.raises(TypeError) as refused:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert str(refused.value).startswith(says), refused.value


def test_sampling_params_take_ints_for_numbers_and_numpy_ids() -> None:
    import numpy as np

    params = SamplingParams(temperature=1, top_p=1, stop_token_ids=np.array([3, 4]))
    assert params.temperature == 1 and params.stop_token_ids == (3, 4)
    assert all(type(t) is int for t in params.stop_token_ids)


def test_the_delayer_gates_every_pass_and_counts_outcomes():
    from scheduler.dist.gather import StaticGather
    from scheduler.prefill.delayer import DelayerConfig, DelayerMetrics, PrefillDelayer

    h = Harness()
    metrics = DelayerMetrics(h.sched.metrics.registry, 30)
    h.sched.delayer = PrefillDelayer(DelayerConfig(), StaticGather(), dp_size=1, attn_tp_size=1,
                                     enable_dp_attention=False, metrics=metrics)
    h.submit("a", 4)
    h.step()  # one rank, prefillable: no reason to wait
    h.step()  # nothing waiting: finalize negotiates "not prefillable"
    assert h.answered() == {"a": (S.DONE, None)}
    assert h.sched.delayer.outcomes == {"no_wait": 1, "none": 1}
    reg = h.sched.metrics.registry
    total = sum(
        s.value for m in reg.collect() if m.name == "pdlife_prefill_delayer_outcomes"
        for s in m.samples if s.name.endswith("_total")
    )
    assert total == 2  # observed exactly once per pass


class FailingRunner:
    """A model runner whose forward raises for prompts containing token 255."""

    def __init__(self, pool) -> None:
        self.inner = PagedModelRunner(MODEL, pool)
        self.pool = pool

    def forward(self, batch: ForwardBatch) -> list[int]:
        if any(255 in item.input_ids for item in batch.items):
            raise RuntimeError("device error")
        return self.inner.forward(batch)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_forward_fails_its_batch_and_the_loop_goes_on(overlap):
    pool = MODEL.make_pool(num_pages=64, page_size=4)
    h = Harness(runner=FailingRunner(pool), overlap=overlap)
    h.pool = pool
    h.sched.submit(NewRequest("bad", (1, 255, 3), bootstrap_host="decode", bootstrap_room=7))
    h.sched.run_until(lambda: len(h.responses) == 1)
    h.submit("good", 5)
    h.sched.run_until(lambda: len(h.responses) == 2)
    h.sched.close()
    assert h.answered() == {"bad": (S.FAILED, FailureReason.INTERNAL), "good": (S.DONE, None)}
    assert "device error" in h.responses[0].detail
    assert h.responses[0].http_status == 500
    h.assert_empty()


def test_step_until_names_its_timeout_when_not_told_what_is_missing() -> None:
    passes: list[int] = []
    with pytest.raises(TimeoutError, match=r"^the condition did not hold within 0\.01 s$"):
        step_until(lambda: passes.append(1) is None, lambda: False, 0.01)
    assert passes  # it stepped meanwhile


def test_a_second_thread_stepping_during_a_pass_is_refused():
    """step() belongs to one thread: a pass begun while another thread is in one is refused
    (it would have run the same requests' transitions twice over); one thread after another
    is fine."""
    pool = MODEL.make_pool(num_pages=64, page_size=4)
    runner = GatedRunner(pool)
    h = Harness(runner=runner)
    h.pool = h.sched.pool = pool
    h.submit("a", 12)
    first = threading.Thread(target=h.sched.step, name="engine")
    first.start()
    assert runner.entered.wait(10)  # the engine thread is inside the pass, in the forward
    with pytest.raises(RuntimeError, match=r"PrefillScheduler.step\(\) called on thread "
                                           r"'MainThread' while thread 'engine' runs a pass"):
        h.sched.step()
    runner.gate.set()
    first.join(30)
    assert not first.is_alive()
    h.sched.run_until(lambda: len(h.responses) == 1)  # this thread steps now
    assert h.answered() == {"a": (S.DONE, None)}
    h.sched.close()
    h.assert_empty()


def test_one_thread_is_reentrant_on_its_holder_only():
    guard = OneThread("Thing")
    with guard, guard:  # a subclass's pass running its base's
        refused: list[BaseException] = []

        def other() -> None:
            try:
                with guard:
                    pass
            except RuntimeError as exc:
                refused.append(exc)

        thread = threading.Thread(target=other, name="other")
        thread.start()
        thread.join(30)
        assert [str(e) for e in refused] == [
            "Thing.step() called on thread 'other' while thread 'MainThread' runs a pass: one "
            "thread steps it (submit and abort are the calls other threads may make)"]
    with guard:  # released: any thread may take it now
        pass


def test_closing_with_live_requests_says_so(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.submit("a", 6)
    h.step()
    with caplog.at_level(logging.WARNING, logger="scheduler.prefill.scheduler"):
        h.sched.close()
    assert "closing a PrefillScheduler with 1 live requests (a)" in caplog.text, caplog.text
