"""The prefix cache in the prefill scheduler: shared prefixes across requests and chunks, the
adder's budgets, ``lpm``, eviction, and abort and failure in every state with shared nodes.

Requests run on the scripted transfer backend (a sender keeps reading its pages until a test
drains it) with the page-echo runner (whose answer depends on every K/V page it reads back) or
the tiny reference model (whose answer must equal the colocated run). Every pass is followed by
``check_invariants()``, which checks invariant 7 (page ownership and lock counts) too.
"""

from __future__ import annotations

import pytest

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pages import pages_needed
from lifecycle import FailureReason, PrefillRequest, PrefillState
from lifecycle.testing import FakeClock
from scheduler.messages import CacheFlushed, NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.prefill.adder import Stop, plan_batch
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.prefix import PrefixCache
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ModelRunner
from scheduler.testing.device import SteppedDevice
from scheduler.testing.fakes import (
    DECODE_HOST,
    PageEchoRunner,
    ScriptedKVManager,
    ScriptedSender,
    echo_next_token,
    echo_runner_factory,
)

S = PrefillState
PS = 4
SYSTEM = tuple(range(40, 56))  # a 16-token "system prompt": 4 whole pages
MODEL = LlamaModel(ModelConfig.tiny(seed=5))
REFERENCE = ReferenceModel(MODEL)


class Rig:
    """A prefill scheduler with the prefix cache on, over the scripted backend."""

    def __init__(self, *, pages: int = 64, slots: int = 4, overlap: bool = False,
                 model: bool = False, **config: object) -> None:
        self.clock = FakeClock()
        self.responses: list[Response] = []
        self.runner: ModelRunner
        if model:
            self.runner = PagedModelRunner(MODEL, MODEL.make_pool(num_pages=pages, page_size=PS))
        else:
            self.runner = echo_runner_factory(pages, PS)
        self.pool = self.runner.pool
        self.kv = ScriptedKVManager(self.pool)
        self.device = SteppedDevice() if overlap else None
        settings: dict[str, object] = dict(page_size=PS, chunked_prefill_size=8,
                                           radix_cache=True, check_invariants=True)
        settings.update(config)
        self.sched = PrefillScheduler(
            config=SchedulerConfig(**settings),  # type: ignore[arg-type]
            runner=self.runner, kv=self.kv, metadata=MetadataBuffers(slots),
            slots=SlotAllocator(slots), clock=self.clock, on_response=self.responses.append,
            overlap=overlap, device=self.device,
        )
        self.prefix = self.sched.prefix
        assert self.prefix is not None
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.rooms = 0

    def submit(self, rid: str, prompt: tuple[int, ...]) -> None:
        self.rooms += 1
        self.prompts[rid] = prompt
        self.sched.submit(NewRequest(rid, prompt, bootstrap_host=DECODE_HOST, bootstrap_port=1,
                                     bootstrap_room=self.rooms))

    def step(self) -> None:
        self.sched.step()
        self.sched.check_invariants()
        read = {p for s in self.kv.senders for p in s.reading}
        held = set(self.pool.allocator.held_pages())
        assert read <= held, f"pages {read - held} are free while a transfer reads them"
        assert not getattr(self.runner, "violations", []), self.runner

    def req(self, rid: str) -> PrefillRequest:
        req = self.sched.lifecycle.get(rid)
        assert req is not None, rid
        return req

    def sender(self, rid: str) -> ScriptedSender:
        room = list(self.prompts).index(rid) + 1
        (sender,) = [s for s in self.kv.senders if s.room == room]
        return sender

    def pump(self, *actions: str) -> None:
        """Every live sender does what it can of ``actions``, then one pass."""
        for sender in self.kv.senders:
            for action in actions:
                if action in sender.actions():
                    sender.act(action)
        self.step()

    def run_until(self, rid: str, state: PrefillState, *actions: str) -> PrefillRequest:
        for _ in range(50):
            req = self.sched.lifecycle.get(rid)
            if req is not None and req.state is state:
                return req
            self.pump(*actions)
        raise AssertionError(f"{rid} never reached {state!r}")

    def finish(self) -> None:
        """Every transfer drains and succeeds, every request ends."""
        for _ in range(100):
            if self.sched.idle():
                break
            self.pump("drain", "handshake", "success")
        assert self.sched.idle()

    def answer(self, rid: str) -> Response:
        (resp,) = [r for r in self.responses if r.rid == rid]
        return resp

    def assert_no_leak(self) -> None:
        """Nothing locked, nothing lost: evicting the whole tree gives every page back."""
        self.finish()
        tree = self.prefix.tree
        assert tree.violations([]) == []
        assert tree.evictable == tree.size, "a tree page stayed locked after its request ended"
        size = tree.size
        assert tree.evict(size) == size and tree.size == 0
        assert self.pool.allocator.available() == self.pool.num_pages
        assert self.sched.slots.available() == self.sched.slots.num_slots


def _metric(rig: Rig, name: str) -> float:
    value = rig.sched.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_a_shared_prefix_is_computed_once_and_reported_as_cached() -> None:
    rig = Rig(model=True)
    a, b = (*SYSTEM, 1, 2, 3), (*SYSTEM, 7, 8)
    rig.submit("a", a)
    rig.finish()
    rig.submit("b", b)
    req = rig.run_until("b", S.TRANSFERRING, "handshake")
    # The whole system prompt came from the cache; only b's own 2 tokens were computed.
    assert req.cached == 16 and req.pages[:4] == list(rig.prefix.tree.match(SYSTEM).pages)
    assert _metric(rig, "pdlife_prefill_tokens_total") == len(a) + 2
    # The transfer still sends every page of the prompt, the cached ones included.
    assert rig.sender("b").reading == req.pages and len(req.pages) == pages_needed(len(b), PS)
    assert req.slot is not None
    row = rig.sched.metadata.read(req.slot)
    assert row is not None and row.cached_tokens == 16
    rig.finish()
    for rid, prompt in (("a", a), ("b", b)):
        assert rig.answer(rid).first_token == REFERENCE.generate(list(prompt), 1)[0]
    assert (rig.answer("a").cached_tokens, rig.answer("b").cached_tokens) == (0, 16)
    assert _metric(rig, "pdlife_prefix_cache_hit_tokens_total") == 16
    assert _metric(rig, "pdlife_prefix_cache_query_tokens_total") == len(a) + len(b)
    assert _metric(rig, "pdlife_prefix_cache_hit_rate") == pytest.approx(16 / (len(a) + len(b)))
    assert _metric(rig, "pdlife_prefix_cache_pages") == 4 + 0  # b's partial page is its own
    rig.assert_no_leak()


def test_a_prefix_computed_in_chunks_is_shared_chunk_by_chunk() -> None:
    """a is chunked (8 tokens a pass); b arrives while a is mid-prompt and starts after the
    pages a has inserted so far; c then finds b's own chunks cached too."""
    rig = Rig(model=True, max_running_requests=4)
    a = tuple(range(100, 140))  # 40 tokens: 5 chunks
    rig.submit("a", a)
    first = rig.run_until("a", S.FORWARD, "handshake")
    while first.computed < 24:
        rig.pump("handshake")
    assert rig.prefix.tree.size == first.computed // PS  # every landed chunk was inserted
    b = a[:24] + tuple(range(200, 220))  # shares a's first 24 tokens, then 20 of its own
    rig.submit("b", b)
    rig.run_until("b", S.FORWARD, "handshake")
    second = rig.req("b")
    assert second.cached == 24
    rig.finish()
    c = (*b, 9)
    rig.submit("c", c)
    third = rig.run_until("c", S.TRANSFERRING, "handshake")
    assert third.cached == 44  # b's chunks (and its last, partial page: no) are cached
    rig.finish()
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        resp = rig.answer(rid)
        assert resp.ok and resp.first_token == REFERENCE.generate(list(prompt), 1)[0], rid
    rig.assert_no_leak()


def test_a_fully_cached_prompt_still_computes_its_last_page() -> None:
    rig = Rig()
    rig.submit("a", SYSTEM)
    rig.finish()
    rig.submit("b", SYSTEM)  # the same 16 tokens: the last token's logits are needed
    req = rig.run_until("b", S.TRANSFERRING, "handshake")
    assert req.cached == 12 and len(req.pages) == 4
    # b recomputed the last page into a page of its own: a duplicate the tree does not adopt.
    assert req.pages[3] not in set(rig.prefix.tree.pages())
    rig.finish()
    assert rig.answer("b").first_token == echo_next_token(SYSTEM)
    rig.assert_no_leak()


def test_the_same_new_prefix_twice_in_one_batch_is_computed_twice_and_cached_once() -> None:
    rig = Rig(chunked_prefill_size=64)
    for rid in ("a", "b"):
        rig.submit(rid, (*SYSTEM, 1, 2))
    rig.pump("handshake")
    rig.pump("handshake")
    assert rig.req("a").state is rig.req("b").state is S.TRANSFERRING
    assert (rig.req("a").cached, rig.req("b").cached) == (0, 0)
    assert rig.prefix.tree.size == 4  # one copy; b's duplicate pages stay b's own
    assert len(rig.sched.owned_pages(rig.req("b"))) == 5
    rig.finish()
    assert rig.answer("a").first_token == rig.answer("b").first_token
    rig.assert_no_leak()


def test_a_request_that_meets_duplicates_never_pins_more_pages_than_its_prompt() -> None:
    """Found by the fuzzer (a scheduler that never went idle): b computes the same first page
    as a in one batch, so a caches it first and b's copy is a duplicate. b needs the whole
    pool; had it locked a's pages too, it could never get its last page."""
    rig = Rig(pages=6, chunked_prefill_size=16)
    b = tuple(range(1, 25))  # 6 pages: the whole pool
    rig.submit("a", (*b[:8], 99))  # 3 pages; a's first chunk and b's share page 0
    rig.submit("b", b)
    rig.step()
    rig.pump("handshake")
    assert rig.req("b").state is S.FORWARD and rig.prefix.tree.size == 2
    assert rig.prefix.tree.evictable == 0  # a's pages: locked by a alone ...
    rig.finish()  # ... and evictable once a is done, so b gets the whole pool
    assert rig.answer("b").ok and rig.answer("b").first_token == echo_next_token(b)
    rig.assert_no_leak()


def test_eviction_frees_least_recently_used_leaves_before_a_request_waits() -> None:
    rig = Rig(pages=16, chunked_prefill_size=64)
    a, b = tuple(range(1, 25)), tuple(range(101, 125))  # 6 whole pages each
    rig.submit("a", a)
    rig.finish()
    rig.submit("b", b)
    rig.finish()
    rig.prefix.tree.match(b)  # b's prefix used again: a is now the least recently used
    assert rig.prefix.tree.size == 12 and rig.pool.allocator.available() == 4
    rig.submit("c", tuple(range(201, 233)))  # 8 pages: 4 free, 4 to evict
    rig.run_until("c", S.TRANSFERRING, "handshake")  # scheduled at once, not waiting
    assert _metric(rig, "pdlife_prefix_cache_evicted_pages_total") >= 4
    assert len(rig.prefix.tree.match(a).pages) < 6  # a's leaf went ...
    assert len(rig.prefix.tree.match(b).pages) == 6  # ... b's stayed
    rig.assert_no_leak()


def test_eviction_never_frees_a_page_a_held_back_transfer_reads() -> None:
    rig = Rig(pages=12, chunked_prefill_size=None)
    rig.submit("a", tuple(range(1, 33)))  # 8 whole pages
    rig.run_until("a", S.TRANSFERRING, "handshake")
    reading = list(rig.sender("a").reading)
    rig.sched.abort("a")
    rig.step()  # FAILED, but the engine still reads: its lock is held back with its pages
    assert rig.answer("a").reason is FailureReason.ABORTED
    assert rig.prefix.tree.evictable == 0
    rig.submit("b", tuple(range(101, 133)))  # needs 8 pages, 4 are free: it must wait
    for _ in range(3):
        rig.pump("handshake")
    assert rig.req("b").state is S.WAITING
    assert set(reading) <= set(rig.pool.allocator.held_pages())
    rig.sender("a").act("drain")
    rig.step()  # the lock goes; the next pass evicts a's pages for b
    rig.run_until("b", S.TRANSFERRING, "handshake")
    rig.assert_no_leak()


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_request_waiting_for_pages_pass_after_pass_does_not_grow_the_eviction_queue(
    policy: str,
) -> None:
    """A request that waits for pages is matched again on every pass, and nothing evicts while
    the pool is not full: the tree's eviction queue must stay the size of the tree."""
    rig = Rig(pages=12, chunked_prefill_size=None, schedule_policy=policy)
    rig.submit("a", (*SYSTEM, 1, 2, 3, 4))  # 5 whole pages cached, an unlocked leaf
    rig.finish()
    rig.submit("c", tuple(range(300, 328)))  # 7 pages, its transfer never ends
    rig.run_until("c", S.TRANSFERRING, "handshake")
    rig.submit("b", (*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8, 9))  # a's 5 pages + 1 new: no room
    for _ in range(300):
        rig.pump("handshake")
    assert rig.req("b").state is S.WAITING and rig.req("b").cached == 0
    tree = rig.prefix.tree
    assert len(tree._leaves) <= tree.size  # one entry per node at most, not one per pass
    rig.sender("c").act("drain")
    rig.run_until("b", S.TRANSFERRING, "success")
    assert rig.req("b").cached == 20
    rig.assert_no_leak()


def test_lpm_schedules_the_longest_cached_prefix_first() -> None:
    def first_scheduled(policy: str) -> str:
        rig = Rig(prefill_max_requests=1, schedule_policy=policy)
        rig.submit("warm", (*SYSTEM, 1))
        rig.finish()
        rig.submit("cold", tuple(range(1, 21)))
        rig.submit("hot", (*SYSTEM, 2, 3, 4, 5))
        rig.step()
        rig.pump("handshake")  # both bootstrapped in one pass, then one is scheduled
        scheduled = [r for r in ("cold", "hot") if rig.req(r).state is not S.WAITING]
        rig.assert_no_leak()
        return scheduled[0]

    assert first_scheduled("fcfs") == "cold"
    assert first_scheduled("lpm") == "hot"


@pytest.mark.parametrize(("policy", "cached"), [("fcfs", 0), ("lpm", 32)])
def test_lpm_leaves_a_request_for_the_next_pass_when_its_batch_computes_its_prefix(
    policy: str, cached: int
) -> None:
    """Two new requests share a 32-token prefix nobody has computed. fcfs computes it twice in
    one batch; lpm schedules the first and leaves the second a pass, to find it cached."""
    rig = Rig(chunked_prefill_size=128, schedule_policy=policy)
    shared = tuple(range(100, 132))
    rig.submit("a", (*shared, 1, 2))
    rig.submit("b", (*shared, 3, 4))
    rig.step()
    rig.pump("handshake")
    assert rig.req("a").state is S.TRANSFERRING
    assert rig.req("b").state is (S.TRANSFERRING if policy == "fcfs" else S.WAITING)
    rig.finish()
    assert (rig.answer("a").cached_tokens, rig.answer("b").cached_tokens) == (0, cached)
    rig.assert_no_leak()


def test_lpm_needs_the_prefix_cache() -> None:
    with pytest.raises(ValueError, match="needs radix_cache"):
        SchedulerConfig(schedule_policy="lpm")
    with pytest.raises(ValueError) as bad:
        SchedulerConfig(radix_cache=True, schedule_policy="lifo")
    # One line (attrs' own validator's message was the tuple of its arguments).
    assert str(bad.value) == "'schedule_policy' must be one of ('fcfs', 'lpm'), got 'lifo'"


def test_the_adder_counts_only_uncached_tokens_and_the_pages_locking_takes() -> None:
    rig = Rig(pages=32)
    rig.submit("warm", (*SYSTEM, 1))
    rig.finish()
    tree = rig.prefix.tree
    req = PrefillRequest("x", input_ids=(*SYSTEM, 9, 9, 9, 9, 9), state=S.WAITING)
    found = tree.match(req.input_ids, max_pages=(len(req.input_ids) - 1) // PS)
    assert found.unlocked == 4
    common = dict(continuing=None, waiting=[req], waiting_len=1, running=0, page_size=PS,
                  chunked_prefill_size=8, max_running_requests=8, prefill_max_requests=None)
    # 5 uncached tokens against max_prefill_tokens, not 21; 2 new pages + 4 locked ones.
    plan = plan_batch(free_pages=6, max_prefill_tokens=5, lookup=lambda r, batch: found, **common)
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.length, chunk.new_pages, chunk.prefix) == (16, 5, 2, found)
    # One page short once the match is locked: a chunk of what fits (one page) ...
    (chunk,) = plan_batch(free_pages=5, max_prefill_tokens=64, lookup=lambda r, batch: found,
                          **common).chunks
    assert (chunk.start, chunk.length, chunk.new_pages) == (16, 4, 1)
    # ... and with no page left beside the ones locking takes, nothing: it waits for pages.
    plan = plan_batch(free_pages=4, max_prefill_tokens=64, lookup=lambda r, batch: found, **common)
    assert (plan.chunks, plan.stop) == ([], Stop.NO_PAGES)


def test_requests_sharing_a_cached_prefix_take_its_pages_out_of_eviction_once() -> None:
    """Two requests of one batch share the cached system prompt nobody locks: it costs the
    batch's page budget once, so both start beside an unrelated request in one pass (a pool of
    7 pages: 4 cached, 3 free, one new page each)."""
    rig = Rig(pages=7, chunked_prefill_size=64)
    rig.submit("warm", (*SYSTEM, 5))
    rig.finish()
    assert (rig.pool.allocator.available(), rig.prefix.tree.evictable) == (3, 4)
    rig.submit("r1", (*SYSTEM, 1, 2, 3))
    rig.submit("r2", (*SYSTEM, 7, 8, 9))
    rig.submit("r3", (201, 202, 203))
    rig.step()
    rig.pump("handshake")  # all three handshaken in one pass, then planned together
    assert [rig.req(r).state for r in ("r1", "r2", "r3")] == [S.TRANSFERRING] * 3
    assert (rig.req("r1").cached, rig.req("r2").cached) == (16, 16)
    assert rig.pool.allocator.available() == 0 and rig.prefix.tree.evictable == 0
    rig.finish()
    for rid in ("r1", "r2", "r3"):
        assert rig.answer(rid).first_token == echo_next_token(rig.prompts[rid])
    rig.assert_no_leak()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_outputs_equal_the_colocated_reference_with_the_cache_on(overlap: bool) -> None:
    rig = Rig(model=True, overlap=overlap, pages=128, slots=8, chunked_prefill_size=12,
              max_prefill_tokens=24, schedule_policy="lpm")
    prompts = {
        "r0": (*SYSTEM, 1, 2, 3),
        "r1": SYSTEM,
        "r2": (*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8, 9),
        "r3": SYSTEM[:10],
        "r4": tuple(range(60, 97)),
        "r5": (*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),
        "r6": (*tuple(range(60, 81)), 5),
    }
    for rid, prompt in prompts.items():
        rig.submit(rid, prompt)
        rig.pump("handshake", "drain", "success")
    rig.finish()
    rig.sched.close()
    for rid, prompt in prompts.items():
        resp = rig.answer(rid)
        assert resp.ok and resp.first_token == REFERENCE.generate(list(prompt), 1)[0], rid
    assert sum(r.cached_tokens for r in rig.responses) > 0
    rig.assert_no_leak()


# -- abort and failure in every state, with shared nodes ----------------------------------------

VICTIM = SYSTEM + tuple(range(1, 21))  # shares the warm system prompt; 3 chunks of its own
OTHER = (*SYSTEM, 77, 78, 79)


def _victim_in(rig: Rig, where: str) -> PrefillRequest:
    """Warm the tree with the system prompt, start OTHER (sharing it), and bring the victim to
    ``where``."""
    rig.submit("warm", (*SYSTEM, 5))
    rig.finish()
    rig.submit("victim", VICTIM)
    rig.submit("other", OTHER)
    rig.step()
    victim = rig.req("victim")
    if where == "bootstrapping":
        return victim
    if where == "waiting":  # handshaken, but max_running_requests=1 and OTHER runs first
        rig.sender("other").act("handshake")
        rig.step()
        rig.sender("victim").act("handshake")
        rig.step()
        assert victim.state is S.WAITING
        return victim
    rig.sender("victim").act("handshake")
    rig.step()
    if where == "mid-chunk":
        assert victim.state is S.FORWARD and victim.cached == 16 and not victim.on_device
        return victim
    if where == "on-device":
        assert victim.on_device
        return victim
    return rig.run_until("victim", S.TRANSFERRING)


CASES = [
    ("bootstrapping", "abort"), ("bootstrapping", "bootstrap_failure"),
    ("waiting", "abort"), ("waiting", "peer_abort"), ("waiting", "transfer_failure"),
    ("mid-chunk", "abort"), ("mid-chunk", "transfer_failure"), ("mid-chunk", "forward_fault"),
    ("on-device", "abort"), ("on-device", "peer_abort"), ("on-device", "forward_fault"),
    ("transferring", "abort"), ("transferring", "transfer_failure"),
    ("transferring", "transfer_timeout"),
]


@pytest.mark.parametrize(("where", "how"), CASES)
def test_abort_and_failure_in_every_state_leave_shared_nodes_intact(where: str, how: str) -> None:
    rig = Rig(pages=24, overlap=where == "on-device",
              max_running_requests=1 if where == "waiting" else 4)
    victim = _victim_in(rig, where)
    if how == "abort":
        rig.sched.abort("victim")
    elif how == "forward_fault":
        assert isinstance(rig.runner, PageEchoRunner)
        rig.runner.fail_next = True
    else:
        rig.sender("victim").act(how)
    for _ in range(4):
        rig.pump("handshake")
    assert victim.is_final, victim
    rig.finish()
    assert not rig.answer("victim").ok
    assert rig.answer("other").first_token == echo_next_token(OTHER)
    # The shared system prompt is still cached and still right: a late request reads it.
    rig.submit("late", (*SYSTEM, 42))
    late = rig.run_until("late", S.TRANSFERRING, "handshake")
    assert late.cached == 16
    rig.finish()
    assert rig.answer("late").first_token == echo_next_token((*SYSTEM, 42))
    rig.assert_no_leak()


def _without_cache() -> PrefillScheduler:
    """A scheduler configured without the prefix cache."""
    runner = echo_runner_factory(8, PS)
    return PrefillScheduler(
        config=SchedulerConfig(page_size=PS, chunked_prefill_size=8), runner=runner,
        kv=ScriptedKVManager(runner.pool), metadata=MetadataBuffers(1), slots=SlotAllocator(1),
    )


def test_the_prefix_cache_is_off_unless_configured() -> None:
    sched = _without_cache()
    assert sched.prefix is None
    assert isinstance(PrefixCache(sched.pool, sched.metrics.prefix).tree.size, int)


def test_a_flush_empties_the_cache_only_when_no_request_is_live() -> None:
    """SGLang's /flush_cache: every cached page back in the pool on the next pass, and the next
    prompt computed cold; refused while a request is live (it holds the pages it matched)."""
    rig = Rig()
    rig.submit("a", (*SYSTEM, 1, 2))
    rig.finish()
    tree = rig.prefix.tree
    assert tree.size == 4
    outcomes: list[CacheFlushed] = []
    rig.submit("b", (*SYSTEM, 3))
    rig.sched.flush_cache(outcomes.append)  # after b, on the same pass: b is live
    rig.step()
    assert outcomes == [CacheFlushed(flushed=False, pages=0, live=1)]
    assert tree.size == 4
    rig.finish()
    assert rig.answer("b").cached_tokens == 16  # the cache it was refused for served it
    rig.sched.flush_cache(outcomes.append)
    assert outcomes[1:] == []  # the outcome comes with the pass
    rig.step()
    assert outcomes[1:] == [CacheFlushed(flushed=True, pages=4, live=0)]
    assert tree.size == 0 and rig.pool.allocator.available() == rig.pool.num_pages
    rig.submit("c", (*SYSTEM, 4))
    rig.finish()
    assert rig.answer("c").cached_tokens == 0  # computed cold
    rig.assert_no_leak()


def test_a_flush_is_refused_while_an_ended_requests_transfer_still_reads_cached_pages() -> None:
    """An abort ends a request whose transfer still reads its pages: its path stays locked
    until the transfer lets go. A flush then would leave those pages cached, so it is refused
    as a live request refuses it (SGLang's inflight queue refuses a flush too)."""
    rig = Rig(pages=24, chunked_prefill_size=64)
    rig.submit("a", (*SYSTEM, 1, 2))
    rig.run_until("a", S.TRANSFERRING, "handshake")  # its 4 whole pages are cached, locked
    rig.sched.abort("a")
    rig.step()
    assert rig.answer("a").reason is FailureReason.ABORTED and len(rig.sched.lifecycle) == 0
    tree = rig.prefix.tree
    outcomes: list[CacheFlushed] = []
    rig.sched.flush_cache(outcomes.append)
    rig.step()
    assert outcomes == [CacheFlushed(flushed=False, pages=0, live=1)]
    assert tree.size == 4
    rig.sender("a").act("drain")
    rig.step()  # the transfer let go: the lock went with it
    rig.sched.flush_cache(outcomes.append)
    rig.step()
    assert outcomes[1:] == [CacheFlushed(flushed=True, pages=4, live=0)]
    assert tree.size == 0 and rig.pool.allocator.available() == rig.pool.num_pages
    rig.submit("b", (*SYSTEM, 3))
    rig.finish()
    assert rig.answer("b").cached_tokens == 0  # computed cold
    rig.assert_no_leak()


def test_a_flush_without_a_prefix_cache_empties_nothing() -> None:
    sched = _without_cache()
    outcomes: list[CacheFlushed] = []
    sched.flush_cache(outcomes.append)
    assert sched.step()  # a flush is work: the loop does not rest on it
    assert outcomes == [CacheFlushed(flushed=False, pages=0, live=0)]
    sched.close()
    with pytest.raises(RuntimeError, match="closed"):
        sched.flush_cache(outcomes.append)
