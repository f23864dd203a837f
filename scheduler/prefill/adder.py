"""The PrefillAdder: which waiting requests (and how much of each) go into the next batch.

SGLang's budgets, on the prefill server (where max_new_tokens is 1 and nothing decodes):
``rem_input`` (max_prefill_tokens), ``rem_chunk`` (chunked_prefill_size), the free KV pages,
``max_running_requests`` and ``prefill_max_requests``. The first request of a batch is always
admitted even past max_prefill_tokens; a chunk is cut at a page boundary; a chunked request
continues first on the next pass; at most one request is mid-chunk at a time. The PrefillDelayer
gates the batch before its first new request is admitted.

With the prefix cache on, a new request starts after its cached prefix (``lookup``): only the
uncached tokens count against the token budgets, and the page budget is the free pages plus
those eviction could free, less the cached pages that locking the prefix takes out of reach of
eviction (SGLang's ``rem_total_tokens`` over free + evictable). A cached page that several
requests of one batch share leaves eviction's reach once: SGLang re-reads the evictable count
after each request locks its prefix; the adder, which locks nothing, remembers the pages the
batch's earlier requests will lock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

import attrs

from kv.pages import pages_needed
from kv.radix import Match
from lifecycle import PrefillRequest


class Stop(enum.Enum):
    """Why the adder stopped adding requests."""

    NONE = "none"  # ran out of candidates
    NO_PAGES = "no_pages"  # KV pool exhausted (SGLang's NO_TOKEN)
    BUDGET = "budget"  # input or chunk token budget spent
    MAX_RUNNING = "max_running"
    MAX_BATCH = "max_batch"
    DELAYED = "delayed"  # the PrefillDelayer said not now


@attrs.frozen
class Chunk:
    """``req`` computes tokens ``start .. start+length-1`` and needs ``new_pages`` more pages.
    A first chunk may start after a cached ``prefix`` (the prefix cache's match)."""

    req: PrefillRequest
    start: int
    length: int
    new_pages: int
    prefix: Match | None = None

    @property
    def last(self) -> bool:
        return self.start + self.length == len(self.req.input_ids)


@attrs.define
class Plan:
    chunks: list[Chunk] = attrs.field(factory=list)
    stop: Stop = Stop.NONE

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


# gate(running, waiting_len) -> allowed; asked once, before the first new request.
Gate = Callable[[int, int], bool]
# lookup(req, batch) -> the cached prefix of a request scheduled for the first time, or None
# to leave it for a later pass (the requests already in ``batch`` are about to compute more of
# its prompt, which it would then find cached).
Lookup = Callable[[PrefillRequest, Sequence[PrefillRequest]], Match | None]


@attrs.define
class Budget:
    """What is left of one batch's budgets while the adder fills it: input tokens
    (``max_prefill_tokens``), chunk tokens (``chunked_prefill_size``; None: no chunking) and
    free KV pages (eviction's included), and the cached pages the batch's prefixes lock
    (``locked``: they left ``pages`` with the first request that locks them)."""

    input_tokens: int
    chunk_tokens: int | None
    pages: int
    locked: set[int] = attrs.field(factory=set)

    def spent(self) -> bool:
        return self.input_tokens <= 0 or (self.chunk_tokens is not None and self.chunk_tokens <= 0)

    def cut(
        self, req: PrefillRequest, page_size: int, first: bool, prefix: Match | None = None
    ) -> Chunk | Stop:
        """The next chunk of ``req`` that fits, or why none does; a request scheduled for the
        first time starts after its cached ``prefix``."""
        start, held, locking = req.scheduled, len(req.pages), 0
        if prefix is not None:
            held, locking = len(prefix.pages), len(self._locking(prefix))
            start = held * page_size
        pages = self.pages - locking  # locking the prefix takes its pages out of eviction
        remaining = len(req.input_ids) - start
        length = remaining
        if self.chunk_tokens is not None and remaining > self.chunk_tokens:
            length = self.chunk_tokens // page_size * page_size
            if length <= 0:
                return Stop.BUDGET
        if not first and pages_needed(length, page_size) * page_size > self.input_tokens:
            return Stop.BUDGET
        new_pages = pages_needed(start + length, page_size) - held
        if new_pages > pages:
            # Fit what the pool can hold when chunking; otherwise wait for pages.
            if self.chunk_tokens is None:
                return Stop.NO_PAGES
            fit = (held + pages) * page_size - start
            length = min(length, fit // page_size * page_size)
            if length <= 0:
                return Stop.NO_PAGES
            new_pages = pages_needed(start + length, page_size) - held
        return Chunk(req, start, length, new_pages, prefix)

    def take(self, chunk: Chunk) -> None:
        locking = set() if chunk.prefix is None else self._locking(chunk.prefix)
        self.pages -= chunk.new_pages + len(locking)
        self.locked |= locking
        self.input_tokens -= chunk.length
        if self.chunk_tokens is not None:
            self.chunk_tokens -= chunk.length

    def _locking(self, prefix: Match) -> set[int]:
        """The cached pages that locking ``prefix`` takes out of eviction's reach: those
        nobody locks now, less those an earlier request of the batch locks first."""
        return set(prefix.unlocked_pages) - self.locked


def _add(
    plan: Plan, budget: Budget, req: PrefillRequest, page_size: int, prefix: Match | None = None
) -> Stop | None:
    """Add the next chunk of ``req`` to ``plan``; why the batch stops, if it does."""
    chunk = budget.cut(req, page_size, first=not plan.chunks, prefix=prefix)
    if isinstance(chunk, Stop):
        return chunk
    plan.chunks.append(chunk)
    budget.take(chunk)
    if not chunk.last:
        # This request is now mid-chunk; nothing else fits behind it this pass.
        return Stop.BUDGET
    return None


def plan_batch(
    *,
    continuing: PrefillRequest | None,
    waiting: Iterable[PrefillRequest],
    waiting_len: int,
    running: int,
    free_pages: int,
    page_size: int,
    max_prefill_tokens: int,
    chunked_prefill_size: int | None,
    max_running_requests: int,
    prefill_max_requests: int | None,
    gate: Gate | None = None,
    lookup: Lookup | None = None,
) -> Plan:
    """Plan one batch; pure apart from the gate and the lookup. ``running`` counts requests
    holding pages (``continuing`` among them); ``waiting`` are WAITING requests in the policy's
    order, ``continuing`` the request mid-chunk; ``free_pages`` counts what eviction could free
    too, and ``lookup`` finds a new request's cached prefix (None: no prefix cache)."""
    plan = Plan()
    budget = Budget(max_prefill_tokens, chunked_prefill_size, free_pages)
    if continuing is not None:
        stop = _add(plan, budget, continuing, page_size)
        if stop is not None:
            plan.stop = stop
            return plan
    # The request mid-chunk holds its pages already: ``running`` counts it, the cap does not
    # count it again.
    started = len(plan.chunks)
    asked = False
    for req in waiting:
        if running + len(plan.chunks) - started >= max_running_requests:
            plan.stop = Stop.MAX_RUNNING
            break
        if prefill_max_requests is not None and len(plan.chunks) >= prefill_max_requests:
            plan.stop = Stop.MAX_BATCH
            break
        if budget.spent():
            plan.stop = Stop.BUDGET
            break
        if gate is not None and not asked:
            asked = True
            if not gate(running, waiting_len):
                plan.stop = Stop.DELAYED
                break
        prefix = None
        if lookup is not None:
            prefix = lookup(req, [c.req for c in plan.chunks])
            if prefix is None:
                continue
        stop = _add(plan, budget, req, page_size, prefix)
        if stop is not None:
            plan.stop = stop
            break
    return plan
