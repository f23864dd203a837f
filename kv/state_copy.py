"""The byte copies of hybrid state between two ranks' state pools (``kv/state_pools.py``), for
the local backend: the draft pool's pages with every chunk, the state items by kind with the last.

Both sides must hold the same kinds with the same geometry (:func:`state_mismatches`); items
move whole (no head or layer slicing: state between parallel layouts is not built). SWA and
draft pages go through :func:`kv.local_copy.copy_pages`; recurrent slots and index pages through
their ``[regions, items, item_elems]`` views (:func:`kv.state_pools.items_view`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import Any

import torch

from kv.local_copy import copy_pages
from kv.pool import KVPool
from kv.state_pools import IndexPool, RecurrentPool, StateKind, StatePools, items_view
from kv.state_shapes import shape_mismatches

State = Mapping[StateKind, Sequence[int]]
AnyPool = KVPool | RecurrentPool | IndexPool


def state_mismatches(src: StatePools, dst: StatePools) -> list[str]:
    """``"name: prefill vs decode"`` for every state pool the two sides disagree on (presence,
    regions, item size, dtype, layout) and the window; empty when state can move between them
    (:func:`kv.state_shapes.shape_mismatches`)."""
    return shape_mismatches(src.shapes(), dst.shapes(), src.window, dst.window)


def pairing(src_state: Mapping[Any, Sized], dst_state: Mapping[Any, Sized]) -> str:
    """Why the items sent (``src_state``) and those received (``dst_state``) do not pair up
    ("" when they do): other kinds, or another count of items of a kind. Kinds are
    :class:`~kv.state_pools.StateKind` or their names (a control message's)."""
    if set(src_state) != set(dst_state):
        return (f"state kinds differ: {sorted(map(str, src_state))} sent, "
                f"{sorted(map(str, dst_state))} received")
    for kind, items in src_state.items():
        if len(items) != len(dst_state[kind]):
            return f"{kind}: {len(items)} items sent, {len(dst_state[kind])} received"
    return ""


def _pool(states: StatePools, kind: StateKind) -> AnyPool | None:
    try:
        return states.state_pool(kind)
    except KeyError:
        return None


def check_state(states: StatePools | None, state: State, side: str) -> str:
    """Why ``state`` cannot be items of ``states`` ("" when it can): a kind the side has no pool
    for, or an item outside its pool."""
    for kind, items in state.items():
        pool = None if states is None else _pool(states, kind)
        if pool is None:
            return f"the {side} side has no {kind} pool"
        count = items_view(pool).shape[1]
        bad = [i for i in items if not 0 <= i < count]
        if bad:
            return f"{kind} item {bad[0]} is not in the {side} pool (0..{count - 1})"
    return ""


def copy_state(src: StatePools, dst: StatePools, src_state: State, dst_state: State) -> int:
    """Copy item ``src_state[kind][i]`` of ``src``'s pool of each kind into item
    ``dst_state[kind][i]`` of ``dst``'s; the bytes moved. The two must list the same kinds,
    with as many items each (ValueError otherwise)."""
    why = pairing(src_state, dst_state)
    if why:
        raise ValueError(why)
    moved = 0
    for kind, src_items in src_state.items():
        dst_items = dst_state[kind]
        a, b = src.state_pool(kind), dst.state_pool(kind)
        if isinstance(a, KVPool) and isinstance(b, KVPool):
            copy_pages(a, b, list(src_items), list(dst_items))
        else:
            src_view, dst_view = items_view(a), items_view(b)
            index = torch.tensor(list(src_items), dtype=torch.long, device=src_view.device)
            rows = src_view.index_select(1, index).to(dst_view.device)
            dst_view.index_copy_(1, index.new_tensor(list(dst_items)).to(dst_view.device), rows)
        view = items_view(a)
        moved += len(src_items) * view.shape[0] * view[0, 0].numel() * view.element_size()
    return moved


def copy_draft(src: StatePools, dst: StatePools, src_pages: list[int],
               dst_pages: list[int]) -> int:
    """Copy the draft pool's copies of a chunk's pages (nothing without a draft pool); the
    bytes moved."""
    if src.draft is None or dst.draft is None or not src_pages:
        return 0
    copy_pages(src.draft, dst.draft, src_pages, dst_pages)
    return src.draft.bytes_of_pages(len(src_pages))


def move_state(src: StatePools | None, dst: StatePools | None, *, src_pages: list[int],
               dst_pages: list[int], last: bool, src_state: State, dst_state: State,
               whole: bool) -> int:
    """What a chunk moves besides the full pool's pages: the draft's copies of its pages, and
    on the ``last`` chunk the state; the bytes moved. ValueError when the sides cannot move it
    (no state pools on the receiving side; ranks that hold parts of pages or layers: ``whole``
    False)."""
    if src is None or (src.draft is None and not src_state):
        return 0
    if dst is None:
        raise ValueError("the decode side has no state pools for this model's state")
    if not whole:
        raise ValueError("state pools move between ranks that hold whole pages of every layer "
                         "only (state between parallel layouts is not built)")
    moved = copy_draft(src, dst, src_pages, dst_pages)
    if last:
        moved += copy_state(src, dst, src_state, dst_state)
    return moved
