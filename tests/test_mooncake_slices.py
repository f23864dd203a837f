"""The engine blocks of a sliced send (kv.mooncake_slices) move exactly what the local slice copy
moves.

Each case fills one prefill and one decode pool with random bytes, applies the blocks with
``ctypes.memmove`` (what the engine does with them, byte for byte) to one copy of the decode
pool and :func:`kv.slice_copy.copy_head_slices` to another, and compares the two whole buffers;
a stage's layers are compared with the layers of the decode pool they must land in. The block
counts are checked too: they are what the TCP transport pays for.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kv.layouts import HeadSlice, SlicePlan, TPLayout, plan_slices
from kv.mooncake_slices import PoolShape, slice_blocks
from kv.pages import coalesce
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.slice_copy import copy_head_slices

LAYERS, PAGE_SIZE, HEAD_DIM, NUM_PAGES = 3, 4, 8, 24
FEW_RUNS = ([3, 4, 5, 9, 10, 20, 21, 22], [13, 14, 0, 1, 2, 3, 17, 18])


def _pool(kv_heads: int, seed: int, layout: KVLayout, layers: int = LAYERS) -> KVPool:
    pool = KVPool(num_layers=layers, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                  kv_heads=kv_heads, head_dim=HEAD_DIM, dtype=torch.bfloat16, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    return pool


def _apply(src: KVPool, dst: KVPool, blocks: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    sbase, dbase = src.buffer.data_ptr(), dst.buffer.data_ptr()
    send, dend = src.buffer.nbytes, dst.buffer.nbytes
    for s, d, n in zip(*(b.tolist() for b in blocks), strict=True):
        assert s >= 0 and d >= 0 and s + n <= send and d + n <= dend, (s, d, n)
        ctypes.memmove(dbase + d, sbase + s, n)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _check_pair(plan: SlicePlan, layout: KVLayout, pages: tuple[list[int], list[int]]) -> None:
    runs = coalesce(*pages)
    for p in range(plan.prefill.tp_size):
        for d in plan.destinations(p):
            src = _pool(plan.prefill.heads_per_rank, p, layout)
            by_blocks = _pool(plan.decode.heads_per_rank, 100 + d, layout)
            by_copy = _pool(plan.decode.heads_per_rank, 100 + d, layout)
            slices = plan.between(p, d)
            blocks = slice_blocks(PoolShape.of(src), PoolShape.of(by_blocks), runs, slices)
            _apply(src, by_blocks, blocks)
            copy_head_slices(src, by_copy, *pages, slices)
            assert torch.equal(_bits(by_blocks.buffer), _bits(by_copy.buffer)), (p, d)
            if not slices:
                assert len(blocks[0]) == 0
            elif plan.whole_pages(p, d):  # as many blocks as the unsliced writer's
                assert len(blocks[0]) == len(runs) * src.regions
            else:  # a block per token slot, layer half and page of each slice
                per_slice = len(pages[0]) * LAYERS * 2 * PAGE_SIZE
                assert len(blocks[0]) == per_slice * len(slices)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_blocks_land_what_the_slice_copy_lands(layout: KVLayout) -> None:
    """Prefill TP {1, 2, 4} x decode TP {1, 2, 4} with 8 heads, GQA replicas and MLA."""
    for tp in (1, 2, 4):
        for td in (1, 2, 4):
            _check_pair(plan_slices(TPLayout(tp, 8), TPLayout(td, 8)), layout, FEW_RUNS)
    for tp, td in ((4, 1), (1, 4), (4, 2)):
        _check_pair(plan_slices(TPLayout(tp, 2), TPLayout(td, 2)), layout, FEW_RUNS)
        _check_pair(plan_slices(TPLayout(tp, 1, mla=True), TPLayout(td, 1, mla=True)), layout,
                    FEW_RUNS)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("heads", [None, range(1, 3)], ids=["whole", "sliced"])
def test_a_stage_writes_its_layers_into_a_whole_model_pool(
    layout: KVLayout, heads: range | None
) -> None:
    """Two stages of 2 and 3 layers fill a 5-layer decode pool; nothing else changes."""
    dst_heads = 4 if heads is None else 2
    dst = _pool(dst_heads, 50, layout, layers=5)
    before = dst.by_layer().clone()
    src_pages, dst_pages = FEW_RUNS
    runs = coalesce(src_pages, dst_pages)
    sent = range(4) if heads is None else heads
    dst_at = range(dst_heads) if heads is None else range(0, 2)
    for first, n in ((0, 2), (2, 3)):
        src = _pool(4, first, layout, layers=n)
        s = HeadSlice(prefill_rank=0, decode_rank=0, heads=sent, src_heads=sent,
                      dst_heads=dst_at)
        blocks = slice_blocks(PoolShape.of(src, first_layer=first), PoolShape.of(dst), runs, [s])
        _apply(src, dst, blocks)
        if heads is None and layout is KVLayout.PAGE_MAJOR:
            assert len(blocks[0]) == len(src_pages)  # a stage's layers of one page
        elif heads is None:
            assert len(blocks[0]) == len(runs) * 2 * n
        got = dst.by_layer()[first : first + n, :, dst_pages][..., dst_at.start : dst_at.stop, :]
        want = src.by_layer()[:, :, src_pages][..., sent.start : sent.stop, :]
        assert torch.equal(_bits(got), _bits(want)), (first, n)
    after = dst.by_layer()
    after[:, :, dst_pages, :, dst_at.start : dst_at.stop] = before[
        :, :, dst_pages, :, dst_at.start : dst_at.stop]
    assert torch.equal(_bits(after), _bits(before))  # nothing else was touched


def test_pools_that_disagree_are_refused() -> None:
    a = PoolShape.of(_pool(4, 0, KVLayout.PAGE_MAJOR))
    s = HeadSlice(prefill_rank=0, decode_rank=0, heads=range(4), src_heads=range(4),
                  dst_heads=range(4))
    with pytest.raises(ValueError, match="head bytes"):
        slice_blocks(a, PoolShape(layout="page_major", num_layers=3, num_pages=24, page_size=4,
                                  kv_heads=4, head_bytes=32), coalesce([0], [0]), [s])
    with pytest.raises(ValueError, match="reaches past"):
        slice_blocks(a, PoolShape.of(_pool(2, 0, KVLayout.PAGE_MAJOR)), coalesce([0], [0]), [s])
    with pytest.raises(ValueError, match="outside a pool"):
        slice_blocks(a, a, coalesce([23, 24], [0, 1]), [s])
