"""The byte copies of the local transfer backend: pages of one pool into pages of another.

Page lists are coalesced into runs consecutive on both sides (:func:`kv.pages.coalesce`) and
each run moves as one slice copy of the pools' ``[regions, pages, region_page_elems]`` views
(:meth:`kv.pool.KVPool.page_view`): one region per layer half with the layer-major layout, one
region in all with the page-major one, so a run of a page-major pool is one contiguous copy.
Between CPU pools a small run goes through numpy byte views, a large one through torch's
multi-threaded copy; between device pools badly scattered lists move with one ``index_select`` /
``index_copy_`` instead. Both pools must share one geometry, layout included (the receiver
checks it when it pairs).

Between ranks of different parallel layouts (:func:`copy_to_rank`) a prefill rank's pages are
not whole decode pages: its head slices of its stage's layers go through
:func:`kv.slice_copy.copy_head_slices` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv.layouts import HeadSlice
from kv.pages import coalesce
from kv.pool import KVPool
from kv.slice_copy import copy_head_slices

# On an accelerator, above this many runs one gather/scatter over the page dimension beats a
# launch per run.
_MAX_SLICE_RUNS = 16
_PARALLEL_COPY_BYTES = 1 << 20  # a run at least this large is copied by torch


def copy_pages(src: KVPool, dst: KVPool, src_pages: list[int], dst_pages: list[int]) -> None:
    """Copy page ``src_pages[i]`` of ``src`` into page ``dst_pages[i]`` of ``dst`` for every
    ``i``: every layer, K and V."""
    src_view, dst_view = src.page_view(), dst.page_view()
    runs = coalesce(src_pages, dst_pages)
    if src_view.device.type == "cpu" and dst_view.device.type == "cpu":
        # A large run goes through torch's copy, which spreads it over the intra-op threads.
        # A small one goes through numpy's single memcpy: torch opens a parallel region per
        # call, and on a busy host with few cores each region can stall on a descheduled
        # thread, which dominates when a chunk has many small runs.
        src_bytes = src_view.view(torch.uint8).numpy()
        dst_bytes = dst_view.view(torch.uint8).numpy()
        row_bytes = src_bytes.shape[0] * src_bytes.shape[2]
        for r in runs:
            if r.length * row_bytes >= _PARALLEL_COPY_BYTES:
                dst_view[:, r.dst_start : r.dst_start + r.length].copy_(
                    src_view[:, r.src_start : r.src_start + r.length]
                )
            else:
                dst_bytes[:, r.dst_start : r.dst_start + r.length] = src_bytes[
                    :, r.src_start : r.src_start + r.length
                ]
        return
    if len(runs) <= _MAX_SLICE_RUNS:
        for r in runs:
            dst_view[:, r.dst_start : r.dst_start + r.length].copy_(
                src_view[:, r.src_start : r.src_start + r.length]
            )
        return
    src_idx = torch.tensor(src_pages, dtype=torch.long, device=src_view.device)
    dst_idx = torch.tensor(dst_pages, dtype=torch.long, device=dst_view.device)
    gathered = src_view.index_select(1, src_idx).to(dst_view.device)
    dst_view.index_copy_(1, dst_idx, gathered)


def copy_to_rank(src: KVPool, dst: KVPool, src_pages: list[int], dst_pages: list[int],
                 slices: Sequence[HeadSlice], layers: range, *, whole: bool) -> int:
    """Copy what one prefill rank owes one decode rank for these pages: its head ``slices``
    of its stage's ``layers`` (the decode pool's layers they land in), whole pages when
    ``whole`` and the stage is every layer. Returns the bytes moved."""
    if not slices:
        return 0
    if whole and len(layers) == dst.num_layers:
        copy_pages(src, dst, src_pages, dst_pages)
        return src.bytes_of_pages(len(src_pages))
    copy_head_slices(src, dst, src_pages, dst_pages, slices, layers=layers)
    heads = sum(len(s.src_heads) for s in slices)
    return src.bytes_of_pages(len(src_pages)) * heads // src.kv_heads
