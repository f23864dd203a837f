"""A hybrid model's state over the Mooncake backend: what a prefill rank writes into a decode
rank's state pools, and when it will not.

Theory of operation
-------------------
Both sides register every pool of their :class:`~kv.state_pools.StatePools` beside the KV pool
(the draft model's KV, the SWA, recurrent and index pools; :func:`pool_memory` describes them)
and the decode rank names them in its ``Register`` (:mod:`kv.wire_state`). The prefill rank
pairs its pools with the registration's (:func:`state_target`) and refuses a registration it
cannot serve: pools that differ in presence, regions, item size, dtype or layout, or another
sliding window (:func:`kv.state_shapes.shape_mismatches`, the local backend's wording), and any
pool between places that are not single ranks (state between parallel layouts is not built).
A refused registration is still known, but every room's destination from it is answered with a
FAILED ``Status`` naming both sides' values (:mod:`kv.mooncake_rooms`), so neither side waits
for a timeout.

What moves is :func:`kv.state_sends.chunk_send`'s rule: every chunk writes the draft pool's
copies of its pages (the same runs as the KV pages), the last chunk writes the state items of
each kind into the items its destination named. Every pool reads as
``[regions, items, item bytes]``, so :func:`item_blocks` writes every kind alike: one engine
block per region and run of items consecutive on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from kv import wire
from kv.pages import Run
from kv.rank_table import RankPlace
from kv.state_pools import StatePools, items_view, shape_of
from kv.state_shapes import shape_mismatches
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
    rank's pool and the decode rank's; or why it serves none of the rooms (``refused``)."""

    pools: Mapping[str, tuple[PoolMemory, PoolMemory]] = attrs.field(factory=dict)
    refused: str = ""

    @property
    def draft(self) -> tuple[PoolMemory, PoolMemory] | None:
        return self.pools.get("draft")


NO_STATE = StateTarget()


def state_target(states: StatePools | None, mine: tuple[PoolMemory, ...], place: RankPlace,
                 reg: wire.Register) -> StateTarget:
    """The state this rank at ``place`` with ``states`` (described by ``mine``) writes into the
    decode rank that sent ``reg``."""
    theirs = {p.name: p for p in reg.state_pools}
    if states is None and not theirs:
        return NO_STATE
    problems = shape_mismatches({} if states is None else states.shapes(),
                                {name: p.shape for name, p in theirs.items()},
                                None if states is None else states.window,
                                reg.state_window or None)
    if problems:
        return StateTarget(refused=f"state pools differ (prefill vs decode session "
                                   f"{reg.session}): {'; '.join(problems)}")
    if place.world_size != 1 or reg.tp_size != 1:
        return StateTarget(refused=(
            f"state pools move between single-rank places only (state between parallel "
            f"layouts is not built): prefill rank {place.rank} of {place.world_size}, decode TP "
            f"size {reg.tp_size}"))
    return StateTarget({p.name: (p, theirs[p.name]) for p in mine})


def item_blocks(src: PoolMemory, dst: PoolMemory, runs: Sequence[Run]) -> Blocks:
    """The blocks that write, in every region, each run of items of ``src`` into ``dst``
    (region by region, one block per run)."""
    item = src.shape.item_len
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    src_ptrs = np.asarray(src.ptrs, dtype=np.int64)[:, None]
    dst_ptrs = np.asarray(dst.ptrs, dtype=np.int64)[:, None]
    return ((src_ptrs + r[:, 0] * item).ravel(), (dst_ptrs + r[:, 1] * item).ravel(),
            np.tile(r[:, 2] * item, len(src.ptrs)))
