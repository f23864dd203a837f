"""The PrefillAdder's budgets: SGLang's rules on the prefill server."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kv.pages import pages_needed
from kv.pool import PageAllocator
from kv.radix import Match, PrefixHold, RadixCache
from lifecycle import PrefillRequest
from scheduler.prefill.adder import Stop, plan_batch


def req(n: int, rid: str = "r", scheduled: int = 0, pages: int = 0) -> PrefillRequest:
    r = PrefillRequest(rid, input_ids=tuple(range(n)))
    r.scheduled = scheduled
    r.pages = list(range(pages))
    return r


def plan(waiting, continuing=None, **kw):
    args = dict(
        continuing=continuing,
        waiting=waiting,
        waiting_len=len(waiting),
        running=0,
        free_pages=1000,
        page_size=16,
        max_prefill_tokens=16384,
        chunked_prefill_size=None,
        max_running_requests=256,
        prefill_max_requests=None,
    )
    args.update(kw)
    return plan_batch(**args)


def test_whole_requests_until_the_input_budget():
    p = plan([req(100, "a"), req(100, "b"), req(100, "c")], max_prefill_tokens=220)
    assert [c.req.rid for c in p.chunks] == ["a", "b"]
    assert [(c.start, c.length, c.new_pages) for c in p.chunks] == [(0, 100, 7), (0, 100, 7)]
    assert p.stop is Stop.BUDGET


def test_first_request_is_always_admitted_past_max_prefill_tokens():
    p = plan([req(5000, "a"), req(10, "b")], max_prefill_tokens=1000)
    assert [(c.req.rid, c.length) for c in p.chunks] == [("a", 5000)]


def test_chunks_are_cut_at_page_boundaries_and_stop_the_batch():
    p = plan([req(1000, "a"), req(10, "b")], chunked_prefill_size=100)
    assert [(c.req.rid, c.start, c.length, c.last) for c in p.chunks] == [("a", 0, 96, False)]
    assert p.stop is Stop.BUDGET


def test_a_chunked_request_continues_first():
    a = req(200, "a", scheduled=96, pages=6)
    p = plan([req(10, "b")], continuing=a, chunked_prefill_size=128)
    assert [(c.req.rid, c.start, c.length, c.new_pages) for c in p.chunks] == [
        ("a", 96, 104, 7),
        ("b", 0, 10, 1),
    ]
    assert p.chunks[0].last


def test_no_pages_without_chunking_waits():
    p = plan([req(100, "a")], free_pages=3)
    assert p.chunks == [] and p.stop is Stop.NO_PAGES


def test_no_pages_with_chunking_fits_what_the_pool_holds():
    p = plan([req(100, "a")], free_pages=3, chunked_prefill_size=1000)
    assert [(c.length, c.new_pages, c.last) for c in p.chunks] == [(48, 3, False)]


def test_max_running_and_batch_caps():
    p = plan([req(1, str(i)) for i in range(10)], running=250)
    assert len(p.chunks) == 6 and p.stop is Stop.MAX_RUNNING
    p = plan([req(1, str(i)) for i in range(10)], prefill_max_requests=3)
    assert len(p.chunks) == 3 and p.stop is Stop.MAX_BATCH


def test_the_request_mid_chunk_counts_once_against_max_running():
    # ``running`` counts it (it holds its pages): two held, one more may start.
    a = req(200, "a", scheduled=96, pages=6)
    p = plan([req(10, "b"), req(10, "c")], continuing=a, running=2, max_running_requests=3)
    assert [c.req.rid for c in p.chunks] == ["a", "b"] and p.stop is Stop.MAX_RUNNING
    p = plan([req(10, "b")], continuing=a, running=2, max_running_requests=2)
    assert [c.req.rid for c in p.chunks] == ["a"] and p.stop is Stop.MAX_RUNNING


def test_gate_is_asked_once_and_can_delay():
    asked = []

    def gate(running: int, waiting_len: int) -> bool:
        asked.append((running, waiting_len))
        return False

    p = plan([req(1, "a"), req(1, "b")], gate=gate, running=4)
    assert p.chunks == [] and p.stop is Stop.DELAYED
    assert asked == [(4, 2)]
    asked.clear()
    p = plan([req(1, "a"), req(1, "b")], gate=lambda r, w: asked.append(r) or True)
    assert len(p.chunks) == 2 and len(asked) == 1


@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
    page_size=st.sampled_from([1, 16, 64]),
    chunk=st.one_of(st.none(), st.integers(1, 40).map(lambda k: k * 64)),
    free=st.integers(0, 200),
    budget=st.integers(1, 8192),
)
def test_plans_respect_every_budget(lengths, page_size, chunk, free, budget):
    waiting = [req(n, str(i)) for i, n in enumerate(lengths)]
    p = plan(waiting, page_size=page_size, chunked_prefill_size=chunk, free_pages=free,
             max_prefill_tokens=budget)
    assert sum(c.new_pages for c in p.chunks) <= free
    for c in p.chunks:
        assert c.length > 0
        assert c.new_pages == pages_needed(c.start + c.length, page_size) - len(c.req.pages)
        if not c.last:
            assert (c.start + c.length) % page_size == 0  # cut at a page boundary
    if chunk is not None:
        assert p.num_tokens <= chunk
    if len(p.chunks) > 1:
        assert p.num_tokens <= budget
    # At most one request is left mid-chunk, and it is the last of the batch.
    assert all(c.last for c in p.chunks[:-1])


# -- with the prefix cache: the page budget counts free pages and evictable ones --------------


class Cached:
    """A prefix cache (the real tree) over a small pool, and the adder's lookup into it, as the
    prefill scheduler's pass uses them: each request is matched once, leaving its last token."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.tree = RadixCache(PageAllocator(num_pages), page_size)
        self.page_size = page_size
        self.holds: list[PrefixHold] = []  # what running requests lock
        self.matches: dict[str, Match] = {}

    def warm(self, tokens: tuple[int, ...], lock: bool = False) -> None:
        """Cache the whole pages of ``tokens`` (a request that ran); ``lock``: it still runs."""
        n = len(tokens) // self.page_size
        pages = self.tree.allocator.alloc(n)
        if not n or pages is None:
            return
        done = self.tree.insert(tokens[: n * self.page_size], pages)
        self.tree.allocator.free([p for p in pages if p not in done.adopted])
        if lock:
            found = self.tree.match(tokens[: n * self.page_size])
            self.holds.append(PrefixHold(self.tree, found))

    def lookup(self, r: PrefillRequest, batch: object = None) -> Match:
        found = self.matches.get(r.rid)
        if found is None:
            limit = (len(r.input_ids) - 1) // self.page_size
            found = self.matches[r.rid] = self.tree.match(r.input_ids, max_pages=limit)
        return found

    def available(self) -> int:
        return self.tree.allocator.available() + self.tree.evictable


def test_a_cached_prefix_shared_in_one_batch_leaves_evictions_reach_once():
    """Two requests share a cached prefix nobody locks: its pages leave eviction's reach once,
    so both fit beside a third, unrelated request (a pool of 7: 3 free pages and 4 cached)."""
    cache = Cached(7, 4)
    system = tuple(range(40, 56))
    cache.warm(system)
    assert (cache.tree.allocator.available(), cache.tree.evictable) == (3, 4)
    waiting = [PrefillRequest("r1", input_ids=(*system, 1, 2, 3)),
               PrefillRequest("r2", input_ids=(*system, 7, 8, 9)),
               PrefillRequest("r3", input_ids=(201, 202, 203))]
    p = plan(waiting, page_size=4, free_pages=cache.available(), lookup=cache.lookup)
    assert [(c.req.rid, c.start, c.new_pages) for c in p.chunks] == [
        ("r1", 16, 1), ("r2", 16, 1), ("r3", 0, 1)]
    assert p.stop is Stop.NONE
    # A fourth page-needing request would not fit: the pool is spent.
    waiting.append(PrefillRequest("r4", input_ids=(211,)))
    cache.matches.clear()
    p = plan(waiting, page_size=4, free_pages=cache.available(), lookup=cache.lookup)
    assert [c.req.rid for c in p.chunks] == ["r1", "r2", "r3"] and p.stop is Stop.NO_PAGES


@st.composite
def cached_scenarios(draw: st.DrawFn) -> tuple[Cached, list[PrefillRequest], int]:
    """A pool partly held by running requests, a tree warmed with prompts that share prefixes
    (some still locked), and waiting prompts that share them too; and the page size."""
    page_size = draw(st.sampled_from([1, 2, 4]))
    cache = Cached(draw(st.integers(4, 40)), page_size)
    bases = draw(st.lists(st.lists(st.integers(0, 3), min_size=24, max_size=24), min_size=1,
                          max_size=3))

    def prompt() -> tuple[int, ...]:
        base = draw(st.sampled_from(bases))
        shared = draw(st.integers(0, len(base)))
        own = draw(st.lists(st.integers(4, 9), max_size=12))
        return (*base[:shared], *own) or (4,)

    for _ in range(draw(st.integers(0, 4))):
        cache.warm(prompt(), lock=draw(st.booleans()))
    cache.tree.allocator.alloc(draw(st.integers(0, cache.tree.allocator.available())))
    waiting = [PrefillRequest(f"w{i}", input_ids=prompt())
               for i in range(draw(st.integers(1, 8)))]
    return cache, waiting, page_size


@given(
    scenario=cached_scenarios(),
    chunk=st.one_of(st.none(), st.integers(1, 8).map(lambda k: k * 4)),
    budget=st.integers(1, 64),
)
def test_plans_over_a_prefix_cache_fit_the_pool_and_stop_only_when_it_is_spent(
    scenario, chunk, budget
):
    """Locking the batch's prefixes and evicting what the batch is short of (as the pass
    does) always frees enough pages: never over-admitted. And a batch stopped for pages stops
    at a request that truly does not fit beside it, however many prefixes the batch shares."""
    cache, waiting, page_size = scenario
    tree, allocator = cache.tree, cache.tree.allocator
    p = plan(waiting, page_size=page_size, chunked_prefill_size=chunk,
             free_pages=cache.available(), max_prefill_tokens=budget, lookup=cache.lookup)
    for c in p.chunks:
        assert c.prefix is not None and c.start == len(c.prefix.pages) * page_size
        assert c.new_pages == pages_needed(c.start + c.length, page_size) - len(c.prefix.pages)
    holds = [PrefixHold(tree, c.prefix) for c in p.chunks if c.prefix is not None]
    need = sum(c.new_pages for c in p.chunks)
    if p.stop is Stop.NO_PAGES:
        blocked = waiting[len(p.chunks)]
        found = cache.lookup(blocked)
        mine = PrefixHold(tree, found)
        room = cache.available() - need
        first_chunk = len(blocked.input_ids) - len(found.pages) * page_size
        if chunk is not None:
            first_chunk = min(first_chunk, page_size)
        assert pages_needed(len(found.pages) * page_size + first_chunk, page_size) - len(
            found.pages) > room, (blocked.rid, room)
        mine.release()
    short = need - allocator.available()
    if short > 0:
        tree.evict(short)
    assert allocator.alloc(need) is not None, "the plan needs more pages than the pool frees"
    assert tree.violations(h.node for h in holds + cache.holds if h.node is not None) == []
