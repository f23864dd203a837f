"""Pools, runners and the transfer of a hybrid reference model's per-request state, shared by
the hybrid-model and speculative-decoding tests."""

from __future__ import annotations

from typing import Literal

from kv.pool import KVPool
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import LlamaModel, PagedModelRunner
from scheduler.model.request_kv import RELEASED, RequestKV, window_pages
from scheduler.model.side_pools import HybridConfig
from scheduler.prefill.config import SchedulerConfig


def make_runner(model: LlamaModel, pages: int, page_size: int, swa_pages: int,
                slots: int) -> PagedModelRunner:
    c = model.config
    return PagedModelRunner(
        model, model.make_pool(num_pages=pages, page_size=page_size),
        swa_pool=model.make_swa_pool(num_pages=swa_pages, page_size=page_size)
        if c.swa_layers else None,
        states=model.make_states(slots) if c.recurrent_layers else None)


def poison_free_pages(pool: KVPool | None) -> None:
    """NaN in every free page: a forward that reads one gives NaN logits, not the reference's
    tokens."""
    if pool is None:
        return
    free = [p for start, n in pool.allocator.free_runs() for p in range(start, start + n)]
    if free:
        pool.page_view()[:, free] = float("nan")


def copy_pages(src: KVPool, dst: KVPool, src_pages: list[int], dst_pages: list[int]) -> None:
    dst.page_view()[:, dst_pages] = src.page_view()[:, src_pages]


def transfer(src: PagedModelRunner, dst: PagedModelRunner, kv: RequestKV, length: int,
             dst_slot: int) -> RequestKV:
    """What the last chunk's send moves: every full-attention page, the SWA pages of the last
    window (``window_pages``) and the recurrent state slot, into pages ``dst`` allocates."""
    out = RequestKV(kv.rid, state_slot=dst_slot)
    got = dst.pool.allocator.alloc(len(kv.pages))
    assert got is not None
    out.pages = got
    if src.swa_pool is not None and dst.swa_pool is not None:
        window = window_pages(src, length)
        got = dst.swa_pool.allocator.alloc(len(window))
        assert got is not None
        out.swa_pages = [RELEASED] * window.start + got
    copy_state(src, dst, kv, out, length)
    return out


def copy_state(src: PagedModelRunner, dst: PagedModelRunner, kv: RequestKV, into: RequestKV,
               length: int) -> None:
    """Copy ``kv``'s pages, last SWA window and state slot in ``src``'s pools to ``into``'s in
    ``dst``'s (a draft model's pools use its target's indices: the same call moves them)."""
    copy_pages(src.pool, dst.pool, kv.pages, into.pages)
    if src.swa_pool is not None and dst.swa_pool is not None:
        window = window_pages(src, length)
        copy_pages(src.swa_pool, dst.swa_pool, [kv.swa_pages[i] for i in window],
                   [into.swa_pages[i] for i in window])
    if src.states is not None and dst.states is not None:
        dst.states[:, into.state_slot] = src.states[:, kv.state_slot]


def hybrid_pair(model: LlamaModel, hybrid: HybridConfig | None, *, page_size: int, pages: int,
                chunk: int | None, overlap: bool = False, metadata_slots: int = 8,
                backend: Literal["local", "mooncake"] = "local") -> EmbeddedPair:
    """An EmbeddedPair of ``model`` over ``backend``, ``pages`` a side, invariants checked,
    holding what ``hybrid`` says beside the full pools."""
    scheduler = SchedulerConfig(page_size=page_size, chunked_prefill_size=chunk,
                                check_invariants=True)
    return EmbeddedPair(PairConfig(model=model.config, scheduler=scheduler, overlap=overlap,
                                   prefill_pages=pages, decode_pages=pages, backend=backend,
                                   metadata_slots=metadata_slots, hybrid=hybrid), model=model)


def assert_empty(pair: EmbeddedPair, pages: int) -> None:
    """Both sides' invariants hold and they hold nothing: every page of ``pages``, SWA page,
    recurrent slot and metadata slot is free."""
    for side in (pair.prefill, pair.decode):
        side.check_invariants()
        assert side.pool.allocator.available() == pages
        assert side.states is None or side.states.all_free()
        assert side.slots.available() == side.slots.num_slots
