"""Copy head slices of pages from one rank's KV pool into another's.

When prefill and decode run different TP sizes a page of one prefill rank holds other heads
than a page of a decode rank (:mod:`kv.layouts`), so a transfer moves head slices, not whole
pages. A slice of a run of pages is strided (one piece per token slot) in either pool layout,
so each run and slice is one strided tensor copy over every layer, K and V, of the pools'
layer-major views (:meth:`kv.pool.KVPool.by_layer`). This is the local backend's byte copy;
the Mooncake backend will express the same slices as engine blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kv.layouts import HeadSlice, SlicePlan
from kv.pages import coalesce
from kv.pool import KVGeometryError, KVPool

# Above this many runs one gather and one scatter per slice beat a copy per run.
_MAX_SLICE_RUNS = 16


def check_sliced_geometry(
    src: KVPool, dst: KVPool, plan: SlicePlan, layers: range | None = None
) -> None:
    """Raise :class:`KVGeometryError` unless ``src`` (a prefill rank's pool) and ``dst`` (a
    decode rank's) agree on everything but their head counts (and layer counts, when ``src``
    holds one pipeline stage's ``layers`` of ``dst``'s), and each holds the heads per rank its
    side of ``plan`` gives it."""
    layer_count = src.num_layers if layers is None else dst.num_layers
    problems = attrs.evolve(src.geometry, kv_heads=dst.kv_heads,
                            num_layers=layer_count).mismatches(dst.geometry)
    if layers is not None and (len(layers) != src.num_layers or layers.stop > dst.num_layers):
        problems.append(f"layers: prefill holds {src.num_layers}, to land in decode layers "
                        f"{layers.start}..{layers.stop} of {dst.num_layers}")
    for side, pool, want in (
        ("prefill", src, plan.prefill.heads_per_rank),
        ("decode", dst, plan.decode.heads_per_rank),
    ):
        if pool.kv_heads != want:
            problems.append(f"{side} kv_heads: pool {pool.kv_heads} vs layout {want}")
    if problems:
        raise KVGeometryError("pools cannot exchange head slices: " + "; ".join(problems))


def copy_head_slices(
    src: KVPool,
    dst: KVPool,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    slices: Sequence[HeadSlice],
    layers: range | None = None,
) -> None:
    """Copy, for every ``i``, the heads ``slices`` name from page ``src_pages[i]`` of ``src``
    into page ``dst_pages[i]`` of ``dst`` (every layer of ``src``, K and V; into ``dst``'s
    ``layers`` when ``src`` holds only those, a pipeline stage's, else into the same layers).

    ``slices`` are the ones from one prefill rank to one decode rank
    (:meth:`kv.layouts.SlicePlan.between`); check the pools with :func:`check_sliced_geometry`.
    """
    for s in slices:
        if s.src_heads.stop > src.kv_heads or s.dst_heads.stop > dst.kv_heads:
            raise KVGeometryError(
                f"slice {s} reaches past the pools' heads (prefill {src.kv_heads}, "
                f"decode {dst.kv_heads})"
            )
    runs = coalesce(src_pages, dst_pages)
    if not runs or not slices:
        return
    src_kv, dst_kv = src.by_layer(), dst.by_layer()
    if layers is not None:
        dst_kv = dst_kv[layers.start : layers.stop]
    if len(runs) <= _MAX_SLICE_RUNS:
        for r in runs:
            for s in slices:
                dst_kv[:, :, r.dst_start : r.dst_start + r.length, :, _cut(s.dst_heads)].copy_(
                    src_kv[:, :, r.src_start : r.src_start + r.length, :, _cut(s.src_heads)]
                )
        return
    src_idx = torch.tensor(list(src_pages), dtype=torch.long, device=src.device)
    dst_idx = torch.tensor(list(dst_pages), dtype=torch.long, device=dst.device)
    # Advanced indexing, not index_select, which first copies a strided view (page-major's
    # by_layer) whole.
    gathered = src_kv[:, :, src_idx].to(dst.device)
    for s in slices:
        dst_kv[:, :, :, :, _cut(s.dst_heads)].index_copy_(
            2, dst_idx, gathered[:, :, :, :, _cut(s.src_heads)]
        )


def _cut(heads: range) -> slice:
    return slice(heads.start, heads.stop)
