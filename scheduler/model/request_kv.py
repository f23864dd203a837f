"""What one request holds in the reference model's pools, and the forward items that use it.

A hybrid reference model (:class:`~scheduler.model.reference_config.LayerKind`) keeps three
kinds of per-request state: full-attention K/V for every position (pages of the runner's
``pool``), sliding-window K/V for the last ``sliding_window`` positions only (pages of its
``swa_pool``) and one recurrent-state slot (a row of its ``states``). :class:`RequestKV` holds a
request's pages of both pools and its slot, grows them as positions are computed, and gives back
the sliding-window pages that no later query can see: a query at ``p`` reads positions
``p - W + 1 .. p``, so before a forward that starts at ``s`` every SWA page wholly before
``s - W + 1`` is released (its table entry becomes -1). That is what makes a sliding-window layer
cost ``O(W)`` memory per request rather than ``O(length)``.

The runner decides the bits; this module only decides where they live, so drivers that use it
(the speculative decoder, tests) compute the same tokens as the colocated twin.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kv.pages import pages_needed
from kv.pool import KVPool
from scheduler.model.reference import PagedModelRunner
from scheduler.runner import ForwardItem

RELEASED = -1


class PoolExhausted(RuntimeError):
    """A pool had no free page for a request's next positions."""

    def __init__(self, rid: str, pool: str) -> None:
        super().__init__(f"request {rid!r}: the {pool} pool has no free page; free one and retry")
        self.rid = rid


def _alloc(pool: KVPool, rid: str, name: str, n: int) -> list[int]:
    pages = pool.allocator.alloc(n)
    if pages is None:
        raise PoolExhausted(rid, name)
    return pages


@attrs.define
class RequestKV:
    """One request's pages (full pool), SWA pages (``RELEASED`` once out of every window) and
    recurrent-state slot (-1 for a model without recurrent layers)."""

    rid: str
    pages: list[int] = attrs.Factory(list)
    swa_pages: list[int] = attrs.Factory(list)
    state_slot: int = -1

    def item(self, runner: PagedModelRunner, input_ids: Sequence[int], start: int,
             all_logits: bool = False, keep_from: int | None = None) -> ForwardItem:
        """The forward item of ``input_ids`` at ``start``, after taking the pages its positions
        need and releasing the SWA pages no query from ``keep_from`` (default ``start``) on
        can see."""
        swa = runner.swa_pool
        if swa is not None:
            model, first = runner.model, start if keep_from is None else min(start, keep_from)
            self.trim(swa, model.window_start(model.config.swa_layers[0], first))
        self.reserve(runner, start + len(input_ids))
        return ForwardItem(self.rid, tuple(input_ids), start, tuple(self.pages), all_logits,
                           tuple(self.swa_pages), self.state_slot)

    def reserve(self, runner: PagedModelRunner, end: int) -> None:
        """Hold the pages of both pools that positions ``0 .. end-1`` need (pages already
        taken stay the request's when a pool runs out: :class:`PoolExhausted`)."""
        grow = pages_needed(end, runner.pool.page_size) - len(self.pages)
        if grow > 0:
            self.pages += _alloc(runner.pool, self.rid, "KV", grow)
        swa = runner.swa_pool
        if swa is not None:
            grow = pages_needed(end, swa.page_size) - len(self.swa_pages)
            if grow > 0:
                self.swa_pages += _alloc(swa, self.rid, "SWA", grow)

    def trim(self, swa: KVPool, first_visible: int) -> None:
        """Release the SWA pages wholly before position ``first_visible``."""
        dead = [i for i in range(min(first_visible // swa.page_size, len(self.swa_pages)))
                if self.swa_pages[i] != RELEASED]
        swa.allocator.free([self.swa_pages[i] for i in dead])
        for i in dead:
            self.swa_pages[i] = RELEASED

    def held_swa_pages(self) -> list[int]:
        """The SWA pages this request still holds."""
        return [p for p in self.swa_pages if p != RELEASED]

    def release(self, runner: PagedModelRunner) -> None:
        """Give every page back (the state slot is the caller's)."""
        runner.pool.allocator.free(self.pages)
        if runner.swa_pool is not None:
            runner.swa_pool.allocator.free(self.held_swa_pages())
        self.pages, self.swa_pages = [], []


def window_pages(runner: PagedModelRunner, length: int) -> range:
    """The SWA page indices (into ``RequestKV.swa_pages``) a request of ``length`` computed
    positions must keep for its next query at ``length``: the pages of positions
    ``page_floor(length - W) .. length - 1``, what the last chunk sends for SWA layers."""
    if runner.swa_pool is None:
        raise ValueError("the model has no sliding-window layers")
    ps, w = runner.swa_pool.page_size, runner.model.config.sliding_window
    return range(max(0, length - w) // ps, pages_needed(length, ps))
