"""The prefix cache on the prefill side: the radix tree (:mod:`kv.radix`) at each step of a pass.

- **plan** — :meth:`PrefixCache.match` gives the longest cached prefix of a waiting request
  (whole pages, and never the whole prompt: the last token is always computed, since its
  logits give the first output token; nor a position whose logits score a prompt token the
  request wants the logprob of). The adder counts only the uncached tokens against its
  budgets, and free plus evictable pages against the pool; ``lpm`` orders the waiting queue by
  match length (:meth:`PrefixCache.begin_pass`) and leaves for the next pass a request whose
  prefix the batch is about to compute (:meth:`PrefixCache.lookup`).
- **launch** — :meth:`PrefixCache.admit` locks the match of each newly scheduled request (its
  page table starts with the tree's pages, ``req.cached`` tokens of it), then evicts
  least-recently-used unlocked leaves if the batch needs more pages than are free.
- **land** — :meth:`PrefixCache.insert` gives the tree a request's computed whole pages after
  each chunk; the request's lock moves to the end of what it inserted.
- **release** — :meth:`PrefixCache.release_of` splits a finished request's page table into its
  own pages and its hold; the :class:`~kv.release.Releaser` frees the one and unlocks the other
  once the transfer is quiescent, so a tree page is never evicted while a transfer reads it.

Ownership (invariant 7): a page is free, or the tree's, or held by exactly one live request
that has not inserted it; a tree node's lock count equals the requests (live, or finished with
their transfer still reading) whose path runs through it. :meth:`PrefixCache.violations`
checks it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from kv.pages import pages_needed
from kv.pool import KVPool
from kv.radix import Match, PrefixHold, RadixCache
from lifecycle import PrefillRequest, PrefillState
from scheduler.prefill.adder import Chunk
from scheduler.prefill.metrics import PrefixCacheMetrics
from scheduler.sample.logprobs import first_scored_position, wants_input_logprobs

# lpm looks every waiting request up; past this many it orders by arrival, as SGLang does, so
# a pass stays cheap under a long queue.
LPM_MAX_QUEUE = 128
# lpm leaves a request for the next pass when a request already in the batch is about to compute
# at least this many more tokens of its prompt than the cache holds (SGLang's in-batch prefix
# check): next pass it finds them cached instead of computing them a second time.
IN_BATCH_MIN_TOKENS = 32


def hold_of(req: PrefillRequest) -> PrefixHold | None:
    """The request's hold on the prefix cache (only :meth:`PrefixCache.admit` stores one)."""
    return cast("PrefixHold | None", req.prefix)


class PrefixCache:
    """The radix tree over ``pool``'s pages and what the pass does with it."""

    def __init__(self, pool: KVPool, metrics: PrefixCacheMetrics, policy: str = "fcfs") -> None:
        self.pool = pool
        self.policy = policy
        self.page_size = pool.page_size
        self.tree = RadixCache(pool.allocator, pool.page_size)
        self.metrics = metrics
        self._matches: dict[str, Match] = {}  # this pass's lookups, by request id

    # -- plan ----------------------------------------------------------------------------------

    def match(self, req: PrefillRequest) -> Match:
        """The longest cached prefix of ``req``'s prompt, leaving at least one token to
        compute; looked up once per pass."""
        found = self._matches.get(req.rid)
        if found is None:
            found = self._matches[req.rid] = self.tree.match(req.input_ids,
                                                             max_pages=self._limit(req))
        return found

    def _limit(self, req: PrefillRequest) -> int:
        """The most pages of ``req``'s prompt a match may cover: never its last token, and
        never a position whose logits score a prompt token it wants the logprob of."""
        computed_from = len(req.input_ids) - 1
        if wants_input_logprobs(req.sampling, len(req.input_ids)):
            computed_from = min(computed_from, first_scored_position(req.sampling))
        return computed_from // self.page_size

    def lookup(self, req: PrefillRequest, batch: Sequence[PrefillRequest]) -> Match | None:
        """The adder's lookup: ``req``'s match, or None under ``lpm`` when a request of
        ``batch`` shares at least :data:`IN_BATCH_MIN_TOKENS` more of its prompt than the
        cache holds (it waits a pass and finds them cached)."""
        found = self.match(req)
        if self.policy != "lpm" or not batch:
            return found
        limit = self._limit(req)
        shared = max(_common_pages(req.input_ids, other.input_ids, self.page_size, limit)
                     for other in batch)
        if (shared - len(found.pages)) * self.page_size >= IN_BATCH_MIN_TOKENS:
            return None
        return found

    def begin_pass(
        self, waiting: Iterable[PrefillRequest], count: int
    ) -> Iterable[PrefillRequest]:
        """Start a pass's planning: forget the previous pass's lookups (evictions may have made
        them stale) and return the ``count`` waiting requests (arrival order) in the order the
        policy schedules them."""
        self._matches.clear()
        if self.policy != "lpm" or count > LPM_MAX_QUEUE:
            return waiting
        return sorted(waiting, key=lambda r: -len(self.match(r).pages))  # stable: fcfs ties

    def pages_available(self) -> int:
        """Pages a batch may use: the free ones and those eviction could free."""
        return self.pool.allocator.available() + self.tree.evictable

    # -- launch --------------------------------------------------------------------------------

    def admit(self, starts: Iterable[tuple[PrefillRequest, Match]], new_pages: int) -> None:
        """Lock the match of each request scheduled for the first time (its page table begins
        with the match's pages), then evict until ``new_pages`` pages are free."""
        for req, found in starts:
            req.prefix = PrefixHold(self.tree, found)
            req.pages = list(found.pages)
            req.cached = req.computed = req.scheduled = len(found.pages) * self.page_size
            self.metrics.on_lookup(len(req.input_ids), req.cached)
        short = new_pages - self.pool.allocator.available()
        if short > 0:
            self.metrics.evicted_pages.inc(self.tree.evict(short))

    # -- land ----------------------------------------------------------------------------------

    def insert_landed(self, chunks: Iterable[Chunk], landed: Iterable[PrefillRequest]) -> None:
        """Insert the ``landed`` requests' pages in batch order: the first scheduled caches a
        prefix two of them computed, the others keep their copies."""
        done = {id(req) for req in landed}
        for chunk in chunks:
            if id(chunk.req) in done:
                self.insert(chunk.req)

    def insert(self, req: PrefillRequest) -> None:
        """Cache the whole pages ``req`` has computed so far."""
        hold = hold_of(req)
        assert hold is not None, f"{req.rid}: computed pages without a prefix hold"
        full = req.computed // self.page_size
        hold.insert(req.input_ids[: full * self.page_size], req.pages[:full])

    # -- release -------------------------------------------------------------------------------

    def release_of(self, req: PrefillRequest) -> tuple[list[int], PrefixHold | None]:
        """What a finished request gives back: its own pages and its hold."""
        hold = hold_of(req)
        return (req.pages if hold is None else hold.own(req.pages)), hold

    def set_gauges(self) -> None:
        self.metrics.pages.set(self.tree.size)
        self.metrics.evictable_pages.set(self.tree.evictable)

    # -- invariant 7 ---------------------------------------------------------------------------

    def owned_pages(self, req: PrefillRequest) -> list[int]:
        """The pages of ``req``'s page table that are its own, not the tree's."""
        return self.release_of(req)[0]

    def violations(
        self, live: Iterable[PrefillRequest], held_back: Iterable[PrefixHold]
    ) -> list[str]:
        """How the live requests, the holds kept until their transfer is quiescent and the tree
        break invariant 7 (conservation itself is the allocator's check)."""
        out: list[str] = []
        holders = []
        tree_pages = set(self.tree.pages())
        for req in live:
            hold = hold_of(req)
            if hold is None:
                if req.pages or req.state in (PrefillState.FORWARD, PrefillState.TRANSFERRING):
                    out.append(f"{req.rid}: in {req.state!r} with pages but no prefix hold")
                continue
            if hold.node is None:
                out.append(f"{req.rid}: a live request whose prefix hold was released")
                continue
            holders.append(hold.node)
            out += _hold_violations(req, hold, tree_pages)
        for hold in held_back:
            if hold.node is None:
                out.append(f"{hold!r}: held back, but already released")
            else:
                holders.append(hold.node)
        return out + self.tree.violations(holders)


def _common_pages(a: Sequence[int], b: Sequence[int], page_size: int, limit: int) -> int:
    """Whole pages ``a`` and ``b`` share from the start, at most ``limit`` (a binary search
    over prefix comparisons, each a C-level tuple compare)."""
    lo, hi = 0, min(limit, len(b) // page_size)
    ta, tb = tuple(a), tuple(b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ta[: mid * page_size] == tb[: mid * page_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _hold_violations(req: PrefillRequest, hold: PrefixHold, tree_pages: set[int]) -> list[str]:
    """A live request's page table against its hold: it begins with the pages of the path it
    locks, which are the shared ones; no other page of it is the tree's; its cached prefix is
    page-aligned."""
    out = []
    assert hold.node is not None
    path = [p for n in reversed(list(hold.node.path())) for p in n.pages]
    if req.pages[: len(path)] != path or hold.shared != set(path):
        out.append(f"{req.rid}: its page table {req.pages} does not begin with its locked path "
                   f"{path} (shared: {sorted(hold.shared)})")
    elsewhere = [p for p in req.pages[len(path) :] if p in tree_pages]
    if elsewhere:
        out.append(f"{req.rid}: tree pages {elsewhere} in its page table, off its locked path")
    ps = hold.cache.page_size
    if req.cached % ps or pages_needed(req.cached, ps) > len(req.pages):
        out.append(f"{req.rid}: cached {req.cached} tokens over {len(req.pages)} pages")
    return out
