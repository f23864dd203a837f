"""The paged KV pool and its page allocator."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given

from kv.pool import KVGeometry, KVPool, KVPoolError, PageAllocator
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
    assert pool.bytes_of_pages(5) == 5 * pool.page_bytes * 2 * 3
    assert pool.bytes_of_pages(10) == pool.buffer.numel() * pool.buffer.element_size()
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
            # Every placement hint too: continue the newest request, or fit a larger one.
            after = live[-1][-1] if live and live[-1] and arg % 2 else None
            fit = 2 * arg if arg % 3 == 0 else None
            pages = alloc.alloc(arg, after=after, fit=fit)
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


def _runs_of(pages: list[int]) -> int:
    return 1 + sum(1 for a, b in itertools.pairwise(pages) if b != a + 1)


def test_alloc_is_best_fit_then_longest_runs_first() -> None:
    alloc = PageAllocator(16)
    assert alloc.alloc(16) == list(range(16))
    alloc.free([1, 2, 5, 6, 7, 8, 9, 11, 12, 13])  # holes of 2, 5 and 3 pages
    assert alloc.free_runs() == [(1, 2), (5, 5), (11, 3)]
    assert alloc.alloc(3) == [11, 12, 13]  # the smallest hole that fits, whole
    assert alloc.alloc(4) == [5, 6, 7, 8]  # the smallest that fits; its tail stays free
    assert alloc.free_runs() == [(1, 2), (9, 1)]
    assert alloc.alloc(3) == [1, 2, 9]  # nothing fits: the longest runs first


def test_alloc_after_continues_the_request_run() -> None:
    alloc = PageAllocator(12)
    first = alloc.alloc(3)
    assert first == [0, 1, 2]
    other = alloc.alloc(2)
    assert other == [3, 4]
    alloc.free(other)
    # Best fit alone would take pages 3..4 anyway; after= also holds when a smaller run fits.
    alloc.free(alloc.alloc(7) or [])
    assert alloc.alloc(2, after=first[-1]) == [3, 4]
    assert alloc.alloc(1, after=99) == [5]  # no free run follows page 99: the usual choice


def test_alloc_fit_places_a_first_chunk_where_the_whole_request_fits() -> None:
    alloc = PageAllocator(20)
    assert alloc.alloc(20) is not None
    alloc.free([0, 1, 2, 3])
    alloc.free(list(range(8, 18)))  # free runs of 4 and 10 pages
    first = alloc.alloc(3, fit=8)
    assert first == [8, 9, 10]  # best fit for 3 would be the 4-page run
    assert alloc.alloc(5, after=first[-1]) == [11, 12, 13, 14, 15]
    assert alloc.free_runs() == [(0, 4), (16, 2)]
    assert alloc.alloc(2, fit=50) == [0, 1]  # no run holds 50: the longest run


@given(alloc_free_ops())
def test_free_runs_stay_maximal_and_mirror_the_free_pages(ops: list[tuple[str, int]]) -> None:
    alloc = PageAllocator(24)
    live: list[list[int]] = []
    for kind, arg in ops:
        if kind == "alloc":
            fits = any(length >= arg for _, length in alloc.free_runs())
            pages = alloc.alloc(arg)
            if pages is not None:
                live.append(pages)
                if fits and arg:  # a run that holds the request is used whole
                    assert pages == list(range(pages[0], pages[0] + arg))
        elif live:
            alloc.free(live.pop(arg % len(live)))
        runs = alloc.free_runs()
        free = [p for start, length in runs for p in range(start, start + length)]
        held = set(alloc.held_pages())
        assert free == sorted(set(range(24)) - held)
        assert all(s + n < t for (s, n), (t, _) in itertools.pairwise(runs))
    for pages in live:
        alloc.free(pages)
    assert alloc.free_runs() == [(0, 24)]


def test_churn_keeps_requests_contiguous() -> None:
    """Requests of 1-24 pages coming and going at 75% occupancy: a new request spans 1.33
    runs on average here, where a LIFO free list shreds it into about one run per page."""
    rng = random.Random(7)
    alloc = PageAllocator(256)
    live: list[list[int]] = []
    spans = []
    for _ in range(2000):
        n = rng.randint(1, 24)
        pages = alloc.alloc(n)
        if pages is None:
            alloc.free(live.pop(rng.randrange(len(live))))
            continue
        spans.append(_runs_of(pages))
        live.append(pages)
        if alloc.in_use() > 192:
            alloc.free(live.pop(min(int(rng.expovariate(1 / 3)), len(live) - 1)))
    assert sum(spans) / len(spans) < 1.5


def test_geometry_mismatches_name_each_field() -> None:
    a = _pool().geometry
    assert a.mismatches(_pool(num_pages=99).geometry) == []
    b = _pool(page_size=8, dtype=torch.bfloat16).geometry
    assert a.mismatches(b) == ["page_size: 4 vs 8", "dtype: torch.float32 vs torch.bfloat16"]
    assert isinstance(a, KVGeometry)

