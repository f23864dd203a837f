"""Page math and coalescing of page lists into runs."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv.pages import (
    Run,
    coalesce,
    page_align_floor,
    page_span,
    pages_covering,
    pages_needed,
)
from tests.strategies import page_pairs


def _expand(runs: list[Run]) -> tuple[list[int], list[int]]:
    src: list[int] = []
    dst: list[int] = []
    for r in runs:
        src.extend(range(r.src_start, r.src_start + r.length))
        dst.extend(range(r.dst_start, r.dst_start + r.length))
    return src, dst


@pytest.mark.parametrize(
    ("tokens", "page_size", "pages", "floor"),
    [(0, 4, 0, 0), (1, 4, 1, 0), (4, 4, 1, 4), (5, 4, 2, 4), (17, 16, 2, 16), (7, 1, 7, 7)],
)
def test_pages_needed_and_align_floor(tokens: int, page_size: int, pages: int, floor: int) -> None:
    assert pages_needed(tokens, page_size) == pages
    assert page_align_floor(tokens, page_size) == floor


def test_page_math_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="page_size"):
        pages_needed(3, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        page_align_floor(-1, 4)
    with pytest.raises(ValueError, match="start <= end"):
        page_span(5, 3, 4)


def test_page_span_and_covering_pages() -> None:
    table = [40, 41, 7, 9]
    assert page_span(0, 4, 4) == range(0, 1)
    assert page_span(3, 9, 4) == range(0, 3)
    assert page_span(8, 8, 4) == range(2, 2)
    assert pages_covering(table, 4, 13, 4) == [41, 7, 9]
    assert pages_covering(table, 5, 5, 4) == []
    with pytest.raises(ValueError, match="need 5 pages"):
        pages_covering(table, 0, 17, 4)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_page_math_properties(tokens: int, page_size: int) -> None:
    n = pages_needed(tokens, page_size)
    assert (n - 1) * page_size < tokens <= n * page_size or tokens == n == 0
    floor = page_align_floor(tokens, page_size)
    assert floor % page_size == 0 and 0 <= tokens - floor < page_size
    assert len(page_span(0, tokens, page_size)) == n


def test_coalesce_splits_where_either_side_breaks() -> None:
    src = [0, 1, 2, 3, 7, 8, 9]
    dst = [10, 11, 5, 6, 7, 8, 20]
    assert coalesce(src, dst) == [Run(0, 10, 2), Run(2, 5, 2), Run(7, 7, 2), Run(9, 20, 1)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="differ in length"):
        coalesce([1, 2], [3])


def test_coalesce_long_lists_use_the_same_runs() -> None:
    src = list(range(1000))
    dst = list(range(500, 1000)) + list(range(0, 500))
    assert coalesce(src, dst) == [Run(0, 500, 500), Run(500, 0, 500)]


@given(page_pairs())
def test_coalesce_round_trips_and_runs_are_maximal(pair: tuple[list[int], list[int]]) -> None:
    src, dst = pair
    runs = coalesce(src, dst)
    assert _expand(runs) == (src, dst)
    assert all(r.length > 0 for r in runs)
    for a, b in pairwise(runs):
        assert not (
            b.src_start == a.src_start + a.length and b.dst_start == a.dst_start + a.length
        ), f"{a} and {b} should have been one run"
