"""The prefill scheduler with state pools (kv.state_pools): SWA pages and the recurrent slot
taken with a request's pages, the last chunk's state_indices handed to the sender, everything
given back exactly once and never while the transfer may read it; then the scheduler fuzzing
machine with the pools on."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import attrs
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import precondition, rule

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from kv.state_pools import IndexPool, RecurrentPool, StateKind, StatePools, SWAPool
from kv.state_sends import window_span
from lifecycle import FailureReason, PrefillState
from lifecycle.testing import FakeClock
from scheduler.messages import NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.testing.fakes import PageEchoRunner, ScriptedKVManager, ScriptedSender
from scheduler.testing.machine import SchedulerMachine, scheduler_machine

S = PrefillState
PS = 4


def make_states(pool: KVPool, *, window: int = 6, swa_pages: int | None = None,
                slots: int = 2) -> StatePools:
    """Every kind of state pool beside ``pool``: an SWA pool of ``swa_pages`` (default: as
    many as the full pool, less one), ``slots`` recurrent slots, index keys, a draft."""
    n = pool.num_pages
    swa = KVPool(num_layers=1, num_pages=swa_pages or max(1, n - 1), page_size=pool.page_size,
                 kv_heads=1, head_dim=2)
    return StatePools(
        pool,
        swa=SWAPool(window=window, pool=swa, full_pages=n),
        recurrent=RecurrentPool.zeros(num_layers=1, num_slots=slots, state_size=4,
                                      dtype=torch.int64),
        index=IndexPool(num_layers=1, num_pages=n, page_size=pool.page_size, dim=2),
        draft=KVPool(num_layers=1, num_pages=n, page_size=pool.page_size, kv_heads=1,
                     head_dim=1),
    )


class Harness:
    def __init__(self, *, pages: int = 16, swa_pages: int | None = None, slots: int = 2,
                 **config: object) -> None:
        self.clock = FakeClock()
        self.responses: list[Response] = []
        self.pool = KVPool(num_layers=1, num_pages=pages, page_size=PS, kv_heads=1, head_dim=1)
        self.states = make_states(self.pool, swa_pages=swa_pages, slots=slots)
        self.kv = ScriptedKVManager(self.pool, self.states)
        fields: dict[str, object] = dict(page_size=PS, chunked_prefill_size=8,
                                         check_invariants=True)
        fields.update(config)
        self.sched = PrefillScheduler(
            config=SchedulerConfig(**fields),  # type: ignore[arg-type]
            runner=PageEchoRunner(self.pool), kv=self.kv, metadata=MetadataBuffers(4),
            slots=SlotAllocator(4), clock=self.clock, on_response=self.responses.append,
            states=self.states,
        )
        self.rooms = 0

    def submit(self, rid: str, n: int) -> ScriptedSender:
        self.rooms += 1
        self.sched.submit(NewRequest(rid, tuple(range(n)), bootstrap_host="decode",
                                     bootstrap_port=1, bootstrap_room=self.rooms))
        self.step()
        return self.kv.live[self.rooms]

    def step(self) -> None:
        self.sched.step()
        self.sched.check_invariants()

    def state_of(self, rid: str) -> PrefillState | None:
        req = self.sched.lifecycle.get(rid)
        return None if req is None else req.state  # type: ignore[return-value]


def test_the_last_chunk_sends_the_window_the_slot_and_every_index_page() -> None:
    h = Harness()
    sender = h.submit("a", 18)  # chunks of 8, 8, 2 tokens
    sender.act("handshake")
    h.step()
    req = h.sched.lifecycle.get("a")
    assert req is not None and req.state is S.FORWARD
    assert req.state_slot is not None and len(req.pages) == 2
    assert sender.reading == req.pages and sender.reading_state == {}  # full pages only
    h.step()
    h.step()
    assert req.state is S.TRANSFERRING and len(req.pages) == 5
    assert h.states.swa is not None
    swa = h.states.swa.translate(req.pages)
    window = [swa[i] for i in window_span(18, 6, PS)]  # tokens [12, 18): pages 3, 4
    assert sender.reading_state == {
        StateKind.SWA: window, StateKind.RECURRENT: [req.state_slot],
        StateKind.INDEX: req.pages,
    }
    sender.act("success")
    h.step()
    assert [r.state for r in h.responses] == [S.DONE]
    assert h.states.all_free() and h.sched.idle()


def test_an_abort_during_the_state_transfer_keeps_the_state_until_the_engine_is_done() -> None:
    h = Harness()
    sender = h.submit("a", 10)
    sender.act("handshake")
    for _ in range(2):
        h.step()
    req = h.sched.lifecycle.get("a")
    assert req is not None and req.state is S.TRANSFERRING
    slot, pages = req.state_slot, list(req.pages)
    assert h.states.recurrent is not None and h.states.swa is not None
    swa = h.states.swa.translate(pages)
    h.sched.abort("a")
    h.step()
    assert [(r.state, r.reason) for r in h.responses] == [(S.FAILED, FailureReason.ABORTED)]
    assert req.state_slot is None and req.pages == []  # the request gave them up...
    # ...to the releaser, which holds them while the engine may still read them.
    assert slot is not None and not h.states.recurrent.allocator.is_free(slot)
    assert set(swa) <= set(h.states.swa.pool.allocator.held_pages())
    assert not h.kv.free_state(sender.reading_state)
    h.step()
    assert not h.states.all_free()
    sender.act("drain")
    h.step()
    assert h.states.all_free() and h.sched.idle() and sender.cleared
    assert h.pool.allocator.available() == h.pool.num_pages


def test_no_more_requests_hold_pages_than_there_are_recurrent_slots() -> None:
    h = Harness(slots=1)
    a, b = h.submit("a", 5), h.submit("b", 5)
    a.act("handshake")
    b.act("handshake")
    h.step()
    h.step()
    assert (h.state_of("a"), h.state_of("b")) == (S.TRANSFERRING, S.WAITING)
    a.act("success")
    h.step()  # a's slot comes back at the end of this pass
    h.step()
    assert h.state_of("b") in (S.FORWARD, S.TRANSFERRING)


def test_a_smaller_swa_pool_bounds_what_is_admitted_and_scheduled() -> None:
    h = Harness(pages=8, swa_pages=3, chunked_prefill_size=None)
    # 4 pages: more than the SWA pool will ever have.
    h.sched.submit(NewRequest("long", tuple(range(4 * PS)), bootstrap_host="decode",
                              bootstrap_port=1, bootstrap_room=99))
    h.step()
    assert [(r.rid, r.reason) for r in h.responses] == [("long", FailureReason.REJECTED)]
    # The pool that bounds it is named: the full pool has room for it.
    assert h.responses[0].detail == (f"the prompt has {4 * PS} tokens; the SWA pool "
                                     f"(HybridConfig.swa_pages) holds at most {3 * PS}")
    a, b = h.submit("a", 2 * PS), h.submit("b", 2 * PS)
    a.act("handshake")
    b.act("handshake")
    h.step()
    h.step()
    # 3 SWA pages: a's 2 fit, b's 2 wait although the full pool has 6 free.
    assert (h.state_of("a"), h.state_of("b")) == (S.TRANSFERRING, S.WAITING)
    assert h.pool.allocator.available() == 6


def test_the_scheduler_refuses_state_pools_it_cannot_honour() -> None:
    pool = KVPool(num_layers=1, num_pages=8, page_size=PS, kv_heads=1, head_dim=1)
    other = KVPool(num_layers=1, num_pages=8, page_size=PS, kv_heads=1, head_dim=1)
    kv = ScriptedKVManager(pool)

    def build(states: StatePools, config: SchedulerConfig, manager: object) -> None:
        PrefillScheduler(config=config, runner=PageEchoRunner(pool), kv=manager,  # type: ignore[arg-type]
                         metadata=MetadataBuffers(1), slots=SlotAllocator(1), states=states)

    plain = SchedulerConfig(page_size=PS)
    with pytest.raises(ValueError, match="built on the runner's KV pool"):
        build(make_states(other), plain, kv)
    cached = SchedulerConfig(page_size=PS, radix_cache=True)
    with pytest.raises(ValueError, match="keeps the full pool's pages only, not SWA pages or "
                                         "recurrent state or index pages or a draft's KV pages "
                                         r"\(speculative decoding\); turn radix_cache off"):
        build(make_states(pool), cached, kv)
    draft = KVPool(num_layers=1, num_pages=8, page_size=PS, kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match=r"only, not a draft's KV pages \(speculative"):
        build(StatePools(pool, draft=draft), cached, kv)

    class NoState:
        pass

    with pytest.raises(ValueError, match="NoState does not carry state pools"):
        build(make_states(pool), plain, NoState())
    build(StatePools(pool), plain, NoState())  # no state to move: any backend will do


MIXED = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=4), layers=4, swa_layers=(0, 2),
                                sliding_window=7, recurrent_layers=(3,)))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_hybrid_model_prefills_the_colocated_first_tokens(overlap: bool) -> None:
    # The reference model's sliding-window and recurrent layers read and write the scheduler's
    # SWA pages and recurrent slots (ForwardItem.swa_pages, state_slot) across chunks; two
    # slots for five requests, so slots are reused, and must start zeroed.
    model, c = MIXED, MIXED.config
    pool = model.make_pool(num_pages=24, page_size=PS)
    swa = model.make_swa_pool(num_pages=20, page_size=PS)
    states = StatePools(pool, swa=SWAPool(window=c.sliding_window, pool=swa, full_pages=24),
                        recurrent=RecurrentPool(model.make_states(2)))
    assert states.recurrent is not None
    kv = ScriptedKVManager(pool, states)
    responses: list[Response] = []
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=PS, chunked_prefill_size=8, check_invariants=True),
        runner=PagedModelRunner(model, pool, swa_pool=swa, states=states.recurrent.buffer),
        kv=kv, metadata=MetadataBuffers(4), slots=SlotAllocator(4), clock=FakeClock(),
        on_response=responses.append, overlap=overlap, states=states,
    )
    prompts = {f"r{n}": tuple((5 * i + n) % 200 for i in range(n)) for n in (6, 13, 21, 30, 9)}
    for room, (rid, prompt) in enumerate(prompts.items(), start=1):
        sched.submit(NewRequest(rid, prompt, bootstrap_host="decode", bootstrap_port=1,
                                bootstrap_room=room))
    for _ in range(100):
        if len(responses) == len(prompts):
            break
        for sender in kv.senders:
            if "handshake" in sender.actions():
                sender.act("handshake")
        # A transfer succeeds once the next one is done too (or nothing else is left), so the
        # pools fragment: a first chunk's SWA pages then land elsewhere than its full pages.
        done = [sender for sender in kv.senders if "success" in sender.actions()]
        if len(done) > 1 or (done and all(r.state is S.TRANSFERRING
                                          for r in sched.lifecycle.live())):
            done[0].act("success")
        sched.step()
        sched.check_invariants()
    sched.close()
    reference = ReferenceModel(model)
    got = {r.rid: (r.state, r.first_token) for r in responses}
    assert got == {rid: (S.DONE, reference.generate(list(p), 1)[0]) for rid, p in prompts.items()}
    assert states.all_free() and pool.allocator.available() == pool.num_pages


# -- the fuzzing machine with the state pools on -------------------------------------------------


@pytest.fixture(autouse=True)
def _quiet_injected_failures() -> Iterator[None]:
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


def _states_small(pool: KVPool) -> StatePools:
    return make_states(pool, window=5, slots=2)


def _hurried(loop: str) -> type[SchedulerMachine]:
    """The scheduler machine with the state pools on and one more rule, ``hurry``: without it
    a program seldom takes a request to its last chunk before teardown, where every transfer
    succeeds; with it aborts, failures and timeouts meet state transfers in flight."""

    class Hurried(scheduler_machine(loop=loop, states=_states_small)):  # type: ignore[misc]
        @precondition(lambda self: self.sched is not None)
        @rule()
        def hurry(self) -> None:
            """Every pending handshake arrives; then two passes."""
            self._begin("hurry")
            for sender in self.scripted.senders:
                if "handshake" in sender.actions():
                    sender.act("handshake")
            self.step()
            self.check_everything()
            self.step()

    return Hurried


_FUZZ = settings(settings.default, max_examples=300, stateful_step_count=30)
TestStatePoolsNormalLoop = _hurried("normal").TestCase
TestStatePoolsNormalLoop.settings = _FUZZ
TestStatePoolsOverlapLoop = _hurried("overlap").TestCase
TestStatePoolsOverlapLoop.settings = _FUZZ
