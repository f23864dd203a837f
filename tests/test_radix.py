"""The prefix cache's radix tree (kv/radix.py): unit tests, and a Hypothesis state machine that
runs random inserts, matches, locks and evictions against a plain model of the same cache."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv.pool import PageAllocator
from kv.radix import PrefixHold, RadixCache, RadixError

PS = 2


def _cache(num_pages: int = 32) -> RadixCache:
    return RadixCache(PageAllocator(num_pages), PS)


def _pages(cache: RadixCache, n: int) -> list[int]:
    pages = cache.allocator.alloc(n)
    assert pages is not None
    return pages


def test_match_is_page_aligned_and_splits_a_node_on_a_partial_match() -> None:
    cache = _cache()
    pages = _pages(cache, 3)
    done = cache.insert([1, 2, 3, 4, 5, 6], pages)
    assert done.adopted == tuple(pages) and cache.size == 3
    # Two whole pages and a half: the match stops at the page boundary, inside the node.
    m = cache.match([1, 2, 3, 4, 5, 9])
    assert m.pages == tuple(pages[:2]) and m.unlocked_pages == tuple(pages[:2])
    assert m.node.end == 2 and m.node.parent is cache.root
    # The node was split: its lower part is a child of the match's node.
    (lower,) = m.node.children.values()
    assert lower.pages == pages[2:] and lower.key == (5, 6)
    assert cache.match([1, 2, 3, 4, 5, 6]).pages == tuple(pages)
    assert cache.match([7, 8]).pages == () and cache.match([1]).pages == ()
    assert cache.violations([]) == []


def test_match_honours_max_pages() -> None:
    cache = _cache()
    pages = _pages(cache, 2)
    cache.insert([1, 2, 3, 4], pages)
    assert cache.match([1, 2, 3, 4], max_pages=1).pages == (pages[0],)
    assert cache.match([1, 2, 3, 4], max_pages=0).pages == ()


def test_insert_keeps_the_trees_pages_and_adopts_only_the_new_suffix() -> None:
    cache = _cache()
    first = _pages(cache, 2)
    cache.insert([1, 2, 3, 4], first)
    mine = _pages(cache, 3)
    done = cache.insert([1, 2, 3, 4, 5, 6], mine)
    # Positions 0 and 1 were cached: the caller's pages there are duplicates and stay its own.
    assert done.adopted == (mine[2],)
    assert cache.match([1, 2, 3, 4, 5, 6]).pages == (*first, mine[2])
    cache.allocator.free(mine[:2])
    assert cache.violations([]) == []


def test_insert_rejects_tokens_that_are_not_whole_pages() -> None:
    cache = _cache()
    with pytest.raises(RadixError, match="whole pages"):
        cache.insert([1, 2, 3], _pages(cache, 2))


def test_locked_paths_are_never_evicted_and_unlocking_makes_them_evictable() -> None:
    cache = _cache(8)
    a, b = _pages(cache, 2), _pages(cache, 2)
    cache.insert([1, 1, 2, 2], a)
    assert cache.insert([1, 1, 3, 3], b).adopted == (b[1],)  # a is split after its first page
    cache.allocator.free([b[0]])  # the duplicate stayed the caller's
    hold = PrefixHold(cache, cache.match([1, 1, 2, 2]))
    assert cache.evictable == 1  # b's second page; the shared first page is locked through a
    assert cache.evict(8) == 1
    assert cache.allocator.available() == 6
    assert cache.match([1, 1, 3, 3]).pages == (a[0],)  # b's leaf went, the shared page stayed
    hold.release()
    assert cache.evictable == 2
    assert cache.evict(1) == 1  # the leaf first ...
    assert cache.evict(1) == 1  # ... then its parent, childless now
    assert cache.size == 0 and cache.allocator.available() == 8
    with pytest.raises(RadixError, match="released twice"):
        hold.release()


def test_eviction_takes_the_least_recently_used_leaf_first() -> None:
    cache = _cache(8)
    a, b, c = _pages(cache, 1), _pages(cache, 1), _pages(cache, 1)
    cache.insert([1, 1], a)
    cache.insert([2, 2], b)
    cache.insert([3, 3], c)
    cache.match([1, 1])  # a is used again: b is now the oldest
    assert cache.evict(1) == 1
    assert cache.allocator.held_pages() == sorted(a + c)
    assert cache.evict(1) == 1
    assert cache.allocator.held_pages() == a


def test_a_leaf_matched_over_and_over_is_queued_for_eviction_once() -> None:
    """A request waiting for pages matches its prompt on every pass; without memory pressure
    nothing evicts, so the eviction queue must not grow with the matches."""
    cache = _cache(8)
    a, b = _pages(cache, 2), _pages(cache, 1)
    cache.insert([1, 1, 2, 2], a)
    cache.insert([3, 3], b)
    for _ in range(1000):
        cache.match([1, 1, 2, 2, 5])
    assert len(cache._leaves) == 2  # one entry per unlocked leaf, not one per match
    assert cache.violations([]) == []
    # The order is still least recently used first: b, then a; then a is used again and
    # outlives c, inserted before that use.
    assert cache.evict(1) == 1 and cache.allocator.held_pages() == sorted(a)
    c = _pages(cache, 1)
    cache.insert([4, 4], c)
    cache.match([1, 1, 2, 2])
    assert cache.evict(1) == 1 and cache.allocator.held_pages() == sorted(a)
    assert cache.evict(1) == 2 and cache.size == 0 and cache.violations([]) == []


def test_a_split_keeps_the_lock_of_the_node_it_cut() -> None:
    cache = _cache()
    pages = _pages(cache, 3)
    cache.insert([1, 2, 3, 4, 5, 6], pages)
    hold = PrefixHold(cache, cache.match([1, 2, 3, 4, 5, 6]))
    assert cache.evictable == 0
    cache.match([1, 2, 9, 9])  # splits the locked node after its first page
    assert cache.violations([hold.node] if hold.node else []) == []
    assert cache.evict(3) == 0
    hold.release()
    assert cache.evict(3) == 3


def test_hold_insert_moves_the_lock_and_shares_adopted_pages() -> None:
    cache = _cache()
    hold = PrefixHold(cache)
    table = _pages(cache, 2)
    assert hold.insert([5, 5, 6, 6], table) == 2
    assert hold.own(table) == [] and cache.evictable == 0
    table += _pages(cache, 1)
    assert hold.insert([5, 5, 6, 6, 7, 7], table) == 1
    assert hold.own(table) == []
    assert hold.node is not None and cache.violations([hold.node]) == []
    hold.release()
    assert cache.evictable == 3
    with pytest.raises(RadixError, match="after release"):
        hold.insert([5, 5], table[:1])


def test_a_hold_that_meets_pages_cached_first_keeps_its_own_and_caches_nothing_more() -> None:
    cache = _cache(8)
    mine = PrefixHold(cache)  # matched nothing; computes [1, 1] [2, 2] [3, 3]
    theirs = _pages(cache, 1)
    cache.insert([1, 1], theirs)  # someone cached the first page meanwhile
    table = _pages(cache, 2)
    assert mine.insert([1, 1, 2, 2], table) == 0 and mine.diverged
    table += _pages(cache, 1)
    assert mine.insert([1, 1, 2, 2, 3, 3], table) == 0
    # It locks nothing of theirs: their page stays evictable, its pages stay its own.
    assert mine.node is cache.root and cache.evictable == 1 and mine.own(table) == table
    assert cache.evict(8) == 1
    mine.release()
    cache.allocator.free(table)
    assert cache.allocator.available() == 8


def test_extend_refuses_an_evicted_node_and_empty_pages() -> None:
    cache = _cache()
    cache.insert([1, 1], _pages(cache, 1))
    node = cache.match([1, 1]).node
    with pytest.raises(RadixError, match="whole pages"):
        cache.extend(node, [], [])
    cache.evict(1)
    with pytest.raises(RadixError, match="evicted"):
        cache.extend(node, [2, 2], _pages(cache, 1))


def test_unlock_without_a_lock_raises_and_changes_nothing() -> None:
    cache = _cache()
    cache.insert([1, 1], _pages(cache, 1))
    node = cache.match([1, 1]).node
    with pytest.raises(RadixError, match="unlocked more often"):
        cache.unlock(node)
    assert node.lock_ref == 0 and cache.evictable == 1


def test_violations_report_a_wrong_lock_count() -> None:
    cache = _cache()
    cache.insert([1, 1], _pages(cache, 1))
    node = cache.match([1, 1]).node
    cache.lock(node)
    assert any("lock count 1, 0 users" in v for v in cache.violations([]))
    assert cache.violations([node]) == []


# -- the tree against a plain model --------------------------------------------------------------


class Request:
    """A user of the cache as the scheduler is: a prompt, a page table, a hold."""

    def __init__(self, tokens: tuple[int, ...], hold: PrefixHold, table: list[int]) -> None:
        self.tokens, self.hold, self.table = tokens, hold, table


class RadixAgainstModel(RuleBasedStateMachine):
    """The model: ``cached`` maps every cached prefix (whole pages of tokens) to the page that
    holds its last page; a prefix is cached only if its own prefixes are. Users lock the
    prefix they hold; a model prefix is locked while some user's prefix extends it."""

    def __init__(self) -> None:
        super().__init__()
        self.num_pages = 12
        self.cache = RadixCache(PageAllocator(self.num_pages), PS)
        self.cached: dict[tuple[int, ...], int] = {}
        self.used: dict[tuple[int, ...], int] = {}  # cached prefix -> when it was last used
        self.clock = 0
        self.requests: list[Request] = []

    def _use(self, tokens: tuple[int, ...], pages: int) -> None:
        """A match or an insert used the first ``pages`` cached pages of ``tokens``."""
        self.clock += 1
        for i in range(1, pages + 1):
            self.used[tokens[: i * PS]] = self.clock

    def _model_match(self, tokens: tuple[int, ...], limit: int) -> tuple[int, ...]:
        out = []
        for i in range(1, limit + 1):
            page = self.cached.get(tokens[: i * PS])
            if page is None:
                break
            out.append(page)
        return tuple(out)

    def _locked(self) -> set[tuple[int, ...]]:
        locked = set()
        for r in self.requests:
            node = r.hold.node
            depth = 0 if node is None else node.end
            for i in range(1, depth + 1):
                locked.add(r.tokens[: i * PS])
        return locked

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=5 * PS),
          limit=st.integers(0, 5))
    def match(self, tokens: list[int], limit: int) -> None:
        t = tuple(tokens)
        m = self.cache.match(t, max_pages=limit)
        assert m.pages == self._model_match(t, min(limit, len(t) // PS))
        locked = self._locked()
        assert m.unlocked_pages == tuple(
            p for i, p in enumerate(m.pages, 1) if t[: i * PS] not in locked)
        self._use(t, len(m.pages))

    @precondition(lambda self: len(self.requests) < 4)
    @rule(tokens=st.lists(st.integers(0, 1), min_size=PS, max_size=5 * PS))
    def start(self, tokens: list[int]) -> None:
        """A request matches its prompt and locks what it found."""
        t = tuple(tokens)
        m = self.cache.match(t)
        self._use(t, len(m.pages))
        self.requests.append(Request(t, PrefixHold(self.cache, m), list(m.pages)))

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data(), grow=st.integers(1, 2))
    def compute(self, data: st.DataObject, grow: int) -> None:
        """A request computes more whole pages of its prompt (evicting first if it must) and
        inserts them."""
        r = data.draw(st.sampled_from(self.requests))
        want = min(len(r.tokens) // PS, len(r.table) + grow) - len(r.table)
        if want <= 0:
            return
        short = want - self.cache.allocator.available()
        if short > 0:
            self._evict(short)
        pages = self.cache.allocator.alloc(want)
        if pages is None:
            return
        r.table += pages
        n = len(r.table)
        assert r.hold.node is not None
        end, diverged = r.hold.node.end, r.hold.diverged
        adopted = r.hold.insert(r.tokens[: n * PS], r.table)
        # The model: a request caches the pages past its path unless someone cached the next
        # page's prefix first; then it keeps its pages and caches nothing more.
        if diverged or r.tokens[: (end + 1) * PS] in self.cached:
            assert adopted == 0 and r.hold.diverged
            return
        new = {r.tokens[: i * PS]: r.table[i - 1] for i in range(end + 1, n + 1)}
        assert not set(new) & set(self.cached)
        self.cached.update(new)
        self._use(r.tokens, n)
        assert adopted == len(new) and r.hold.node.end == n
        assert r.hold.shared == set(r.table)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.requests))
        self.requests.remove(r)
        self.cache.allocator.free(r.hold.own(r.table))
        r.hold.release()

    @rule(n=st.integers(1, 12))
    def evict(self, n: int) -> None:
        self._evict(n)

    def _evict(self, n: int) -> None:
        locked = self._locked()
        evictable = sum(1 for k in self.cached if k not in locked)
        assert self.cache.evictable == evictable
        free_before = set(range(self.num_pages)) - set(self.cache.allocator.held_pages())
        before = dict(self.cached)
        freed = self.cache.evict(n)
        free_after = set(range(self.num_pages)) - set(self.cache.allocator.held_pages())
        gone = free_after - free_before
        assert len(gone) == freed >= min(n, evictable)
        for key in [k for k, p in self.cached.items() if p in gone]:
            assert key not in locked, f"evicted the locked prefix {key}"
            del self.cached[key]
        # What is left is still prefix-closed: a leaf went, never an inner page.
        for key in self.cached:
            assert all(key[: i * PS] in self.cached for i in range(1, len(key) // PS))
        # Least recently used first: every unlocked leaf left was used after every page that
        # went (or at the same moment, as the pages of one node are).
        went = [self.used[k] for k, p in before.items() if p in gone]
        leaves = [self.used[k] for k in self.cached if k not in locked and not any(
            len(o) == len(k) + PS and o[: len(k)] == k for o in self.cached)]
        if went and leaves:
            assert max(went) <= min(leaves), (went, leaves)

    @invariant()
    def consistent(self) -> None:
        holders = [r.hold.node for r in self.requests if r.hold.node is not None]
        assert self.cache.violations(holders) == []
        assert self.cache.size == len(self.cached)
        assert sorted(self.cache.pages()) == sorted(self.cached.values())
        own = [r.hold.own(r.table) for r in self.requests]
        self.cache.allocator.check_conservation([list(self.cache.pages()), *own])

    def teardown(self) -> None:
        for r in self.requests:
            self.cache.allocator.free(r.hold.own(r.table))
            r.hold.release()
        self.cache.evict(self.num_pages)
        assert self.cache.size == 0
        assert self.cache.allocator.available() == self.num_pages


TestRadixAgainstModel = RadixAgainstModel.TestCase
