"""A hybrid model's state over the Mooncake backend: what a prefill rank writes into a decode
rank's state pools, and when it will not.

Theory of operation
-------------------
Both sides register every pool of their :class:`~kv.state_pools.StatePools` beside the KV pool
(the draft model's KV, the SWA, recurrent and index pools; :func:`pool_memory` describes them)
and the decode rank names them in its ``Register`` (:mod:`kv.wire_state`). The prefill rank
pairs its pools with the registration's (:func:`state_target`) and refuses a registration it
cannot serve: pools that differ, once the two places' layouts are accounted for
(:func:`kv.state_routes.decode_shape`), in presence, regions, item size, dtype or layout, or
another sliding window (:func:`kv.state_shapes.shape_mismatches`, the local backend's wording).
A refused registration is still known, but every room's destination from it is answered with a
FAILED ``Status`` naming both sides' values (:mod:`kv.mooncake_rooms`), so neither side waits
for a timeout.

What moves is :func:`kv.state_sends.chunk_send`'s rule: every chunk writes the draft pool's
copies of its pages (the same runs as the KV pages), the last chunk writes the state items of
each kind into the items its destination named; between parallel layouts only this rank's
shares (:func:`kv.state_routes.state_duty`). Every pool reads as
``[regions, items, item bytes]``: :func:`item_blocks` writes whole items, one engine block per
region and run of items consecutive on both sides, into the decode pool's regions of this
rank's stage; :func:`column_blocks` a recurrent slot's channels. A KV pool's head slices are
:mod:`kv.mooncake_slices`' blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from kv import wire
from kv.layouts import SlicePlan
from kv.pages import Run
from kv.routes import SenderDuty
from kv.state_copy import owed_state
from kv.state_pools import StatePools, items_view, shape_of
from kv.state_routes import KV_POOLS, StateShare, decode_shape
from kv.state_shapes import StateShape, shape_mismatches
from kv.wire_state import PoolMemory

Blocks = tuple[np.ndarray, np.ndarray, np.ndarray]  # source addresses, destinations, lengths


def pool_memory(states: StatePools | None) -> tuple[PoolMemory, ...]:
    """Every pool of ``states`` beside the KV pool, with each region's address."""
    if states is None:
        return ()
    out = []
    for name, pool in states.named_pools().items():
        view = items_view(pool)
        out.append(PoolMemory(name, shape_of(pool),
                              tuple(view[r].data_ptr() for r in range(view.shape[0]))))
    return tuple(out)


@attrs.frozen
class StateTarget:
    """What a prefill rank writes into one decode rank's state pools: per pool name, this
    rank's pool and the decode rank's, and this rank's share of it (a pool without one is not
    written); or why it serves none of the rooms (``refused``)."""

    pools: Mapping[str, tuple[PoolMemory, PoolMemory]] = attrs.field(factory=dict)
    shares: Mapping[str, StateShare] = attrs.field(factory=dict)
    refused: str = ""
    #: Bytes of one channel of the recurrent state.
    recurrent_elem: int = 0

    @property
    def draft(self) -> tuple[PoolMemory, PoolMemory] | None:
        return self.pools.get("draft") if "draft" in self.shares else None


NO_STATE = StateTarget()


def decode_layers(name: str, mine: StateShape, theirs: StateShape, held: range,
                   plan: SlicePlan) -> int:
    """The layers the decode rank's pool ``name`` holds, from its registered shape."""
    if name not in KV_POOLS:
        return theirs.regions
    if theirs.layout != "page_major":
        return theirs.regions // 2
    per_layer = mine.item_len // len(held) // plan.prefill.heads_per_rank
    return theirs.item_len // max(1, per_layer * plan.decode.heads_per_rank)


def state_target(states: StatePools | None, mine: tuple[PoolMemory, ...], duty: SenderDuty,
                 reg: wire.Register) -> StateTarget:
    """The state this rank with ``states`` (described by ``mine``), owing ``duty`` of its
    pages, writes into the decode rank that sent ``reg``."""
    theirs = {p.name: p for p in reg.state_pools}
    if states is None and not theirs:
        return NO_STATE
    shapes = {} if states is None else states.shapes()
    held = {} if states is None else states.stage_layers()
    beyond = []
    for name, shape in list(shapes.items()):
        if name in theirs:
            layers = decode_layers(name, shape, theirs[name].shape, held[name], duty.plan)
            shapes[name] = decode_shape(shape, name, held[name], layers, duty.plan)
            if held[name].stop > layers:
                beyond.append(f"{name} layers: prefill {held[name].start}..{held[name].stop} "
                              f"vs decode {layers}")
    problems = shape_mismatches(shapes, {name: p.shape for name, p in theirs.items()},
                                None if states is None else states.window,
                                reg.state_window or None) + beyond
    if problems:
        return StateTarget(refused=f"state pools differ (prefill vs decode session "
                                   f"{reg.session}): {'; '.join(problems)}")
    shares = owed_state(states, duty).shares(reg.tp_rank)
    elem = 0 if states is None or states.recurrent is None else (
        states.recurrent.buffer.element_size())
    return StateTarget({p.name: (p, theirs[p.name]) for p in mine},
                       {share.name: share for share in shares}, recurrent_elem=elem)


def item_blocks(src: PoolMemory, dst: PoolMemory, runs: Sequence[Run],
                first_region: int = 0) -> Blocks:
    """The blocks that write, in every region, each run of items of ``src`` into ``dst``
    (region by region, one block per run), into ``dst``'s regions from ``first_region``."""
    item = src.shape.item_len
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    src_ptrs = np.asarray(src.ptrs, dtype=np.int64)[:, None]
    dst_ptrs = np.asarray(dst.ptrs[first_region : first_region + len(src.ptrs)],
                          dtype=np.int64)[:, None]
    return ((src_ptrs + r[:, 0] * item).ravel(), (dst_ptrs + r[:, 1] * item).ravel(),
            np.tile(r[:, 2] * item, len(src.ptrs)))


def column_blocks(src: PoolMemory, dst: PoolMemory, share: StateShare,
                  pairs: Sequence[tuple[int, int]], elem: int) -> Blocks:
    """The blocks that write a recurrent ``share``'s channels (``elem`` bytes each) of each
    ``(src item, dst item)`` in every layer this rank holds: one block per layer and item."""
    src_ptrs = np.asarray(src.ptrs, dtype=np.int64)[:, None]
    dst_ptrs = np.asarray(dst.ptrs[share.layers.start : share.layers.start + len(src.ptrs)],
                          dtype=np.int64)[:, None]
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    src_at = src_ptrs + p[:, 0] * src.shape.item_len + share.src_cols.start * elem
    dst_at = dst_ptrs + p[:, 1] * dst.shape.item_len + share.dst_cols.start * elem
    return (src_at.ravel(), dst_at.ravel(),
            np.full(src_at.size, len(share.src_cols) * elem, dtype=np.int64))
