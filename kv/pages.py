"""Page math: tokens to pages, bytes of pages, and coalescing of page lists into contiguous
runs.

A request's KV lives in a list of pages (its page table): token position ``p`` is in page
``pages[p // page_size]`` at offset ``p % page_size``. Every page of a request is full except
possibly the last.

A transfer copies source page ``src[i]`` to destination page ``dst[i]`` for every ``i``.
:func:`coalesce` splits the two lists into runs where both sides are consecutive, so a run of
``length`` pages is one contiguous region on each side and moves with one copy (or one
transfer-engine write) per layer half instead of one per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Below this many pages a Python loop beats the fixed cost of building numpy arrays.
_NUMPY_MIN_PAGES = 64


def _check_page_size(page_size: int) -> None:
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``."""
    _check_page_size(page_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // page_size)


def kv_bytes(num_pages: int, *, page_bytes: int, num_layers: int) -> int:
    """Bytes of ``num_pages`` pages of a pool over every layer, K and V, where ``page_bytes``
    is one page of one layer's K (or V)."""
    return num_pages * page_bytes * 2 * num_layers


class Run(NamedTuple):
    """``length`` consecutive pages from ``src_start`` go to consecutive pages from ``dst_start``.

    A tuple rather than an attrs record: transfers build thousands of them per chunk.
    """

    src_start: int
    dst_start: int
    length: int


def coalesce(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Run]:
    """Split the page pairs ``(src[i], dst[i])`` into maximal runs consecutive on both sides.

    Expanding the runs in order gives back both lists exactly.
    """
    n = len(src_pages)
    if n != len(dst_pages):
        raise ValueError(f"page lists differ in length: {n} source, {len(dst_pages)} destination")
    if n == 0:
        return []
    if n < _NUMPY_MIN_PAGES:
        return _coalesce_small(src_pages, dst_pages)
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    columns = zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist(), strict=True)
    return [Run(s, d, k) for s, d, k in columns]


def _coalesce_small(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Run]:
    runs: list[Run] = []
    s0, d0, length = int(src_pages[0]), int(dst_pages[0]), 1
    for s, d in zip(src_pages[1:], dst_pages[1:], strict=True):
        if s == s0 + length and d == d0 + length:
            length += 1
        else:
            runs.append(Run(s0, d0, length))
            s0, d0, length = int(s), int(d), 1
    runs.append(Run(s0, d0, length))
    return runs
