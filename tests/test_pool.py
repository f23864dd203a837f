"""The paged KV pool, its page allocator and the request-row pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from kv.pool import KVGeometry, KVPool, KVPoolError, PageAllocator, RowPool
from tests.strategies import alloc_free_ops


def _pool(**overrides: object) -> KVPool:
    kwargs: dict[str, object] = {
        "num_layers": 3, "num_pages": 10, "page_size": 4, "kv_heads": 2, "head_dim": 8,
        **overrides,
    }
    return KVPool(**kwargs)  # type: ignore[arg-type]


def test_pool_layout_views_and_page_bytes() -> None:
    pool = _pool(dtype=torch.float16)
    assert pool.buffer.shape == (3, 2, 10, 4, 2, 8)
    assert pool.page_bytes == 4 * 2 * 8 * 2
    assert pool.capacity_tokens == 40
    pool.k(1)[2].fill_(1.0)
    pool.v(1)[2].fill_(2.0)
    view = pool.page_view()
    assert view.shape == (6, 10, 64)
    assert view.data_ptr() == pool.buffer.data_ptr()
    assert torch.all(view[2, 2] == 1.0) and torch.all(view[3, 2] == 2.0)
    assert view[2, 3].abs().sum() == 0


def test_pool_rejects_empty_dimensions() -> None:
    with pytest.raises(ValueError, match="kv_heads must be > 0"):
        _pool(kv_heads=0)


def test_usage_tracks_allocation() -> None:
    pool = _pool()
    assert pool.usage() == 0.0
    pages = pool.allocator.alloc(4)
    assert pages is not None and len(set(pages)) == 4
    assert pool.usage() == pytest.approx(0.4)
    pool.allocator.free(pages)
    assert pool.usage() == 0.0


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(5) is None
    assert alloc.available() == 4
    assert alloc.alloc(0) == []
    with pytest.raises(ValueError, match="cannot allocate -1"):
        alloc.alloc(-1)


def test_double_free_and_foreign_pages_are_detected_and_change_nothing() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    assert pages is not None
    alloc.free(pages[:1])
    with pytest.raises(KVPoolError, match="freed twice"):
        alloc.free(pages)
    with pytest.raises(KVPoolError, match="not in this pool"):
        alloc.free([4])
    with pytest.raises(KVPoolError, match="twice"):
        alloc.free([pages[1], pages[1]])
    assert alloc.available() == 3
    assert alloc.held_pages() == [pages[1]]
    alloc.check_conservation([[pages[1]]])


def test_conservation_check_names_what_is_wrong() -> None:
    alloc = PageAllocator(6)
    a, b = alloc.alloc(2), alloc.alloc(2)
    assert a is not None and b is not None
    alloc.check_conservation([a, b])
    with pytest.raises(KVPoolError, match="neither free nor held"):
        alloc.check_conservation([a])
    with pytest.raises(KVPoolError, match="held by two requests"):
        alloc.check_conservation([a, b, a[:1]])
    free_page = next(p for p in range(6) if p not in a + b)
    with pytest.raises(KVPoolError, match="also free"):
        alloc.check_conservation([a, b, [free_page]])
    with pytest.raises(KVPoolError, match="not in this pool"):
        alloc.check_conservation([[99]])


@given(alloc_free_ops())
def test_random_alloc_free_sequences_conserve_pages(ops: list[tuple[str, int]]) -> None:
    alloc = PageAllocator(24)
    live: list[list[int]] = []
    for kind, arg in ops:
        if kind == "alloc":
            pages = alloc.alloc(arg)
            if pages is None:
                assert arg > alloc.available()
            else:
                assert len(pages) == arg
                live.append(pages)
        elif live:
            alloc.free(live.pop(arg % len(live)))
        alloc.check_conservation(live)
        assert alloc.in_use() == sum(len(p) for p in live)
    for pages in live:
        alloc.free(pages)
    assert alloc.available() == 24


def test_geometry_mismatches_name_each_field() -> None:
    a = _pool().geometry
    assert a.mismatches(_pool(num_pages=99).geometry) == []
    b = _pool(page_size=8, dtype=torch.bfloat16).geometry
    assert a.mismatches(b) == ["page_size: 4 vs 8", "dtype: torch.float32 vs torch.bfloat16"]
    assert isinstance(a, KVGeometry)


def test_row_pool_is_fifo_and_returns_none_when_exhausted() -> None:
    rows = RowPool(2)
    r0, r1 = rows.alloc(), rows.alloc()
    assert (r0, r1) == (0, 1)
    assert rows.alloc() is None
    assert r0 is not None and r1 is not None
    rows.extend(r0, [5, 6])
    rows.extend(r0, [9])
    assert rows.pages(r0) == [5, 6, 9]
    assert rows.live_pages() == [[5, 6, 9], []]
    assert rows.free(r0) == [5, 6, 9]
    assert rows.available() == 1
    with pytest.raises(KVPoolError, match="not allocated"):
        rows.free(r0)
    with pytest.raises(KVPoolError, match="not in this pool"):
        rows.pages(7)
    rows.free(r1)
    assert rows.alloc() == r0  # FIFO: the row freed first comes back first
