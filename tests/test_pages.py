"""Page math and coalescing of page lists into runs."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv.pages import Run, coalesce, kv_bytes, pages_needed
from tests.strategies import page_pairs


def _expand(runs: list[Run]) -> tuple[list[int], list[int]]:
    src: list[int] = []
    dst: list[int] = []
    for r in runs:
        src.extend(range(r.src_start, r.src_start + r.length))
        dst.extend(range(r.dst_start, r.dst_start + r.length))
    return src, dst


@pytest.mark.parametrize(
    ("tokens", "page_size", "pages"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (17, 16, 2), (7, 1, 7)],
)
def test_pages_needed(tokens: int, page_size: int, pages: int) -> None:
    assert pages_needed(tokens, page_size) == pages


def test_page_math_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="page_size"):
        pages_needed(3, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        pages_needed(-1, 4)


def test_kv_bytes_counts_k_and_v_of_every_layer() -> None:
    assert kv_bytes(0, page_bytes=128, num_layers=3) == 0
    assert kv_bytes(5, page_bytes=128, num_layers=3) == 5 * 128 * 2 * 3


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_page_math_properties(tokens: int, page_size: int) -> None:
    n = pages_needed(tokens, page_size)
    assert (n - 1) * page_size < tokens <= n * page_size or tokens == n == 0


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
