"""The byte copies of hybrid state between two ranks' state pools (``kv/state_pools.py``), for
the local backend: the draft pool's pages with every chunk, the state items by kind with the last.

What one prefill rank writes into one decode rank is :func:`kv.state_routes.state_duty`'s
shares: whole items between equal layouts; between TP sizes a KV pool's head slices
(:func:`kv.local_copy.copy_to_rank`, as the full pages) and a recurrent slot's channels; with
pipeline stages each into the decode pool's layers of the stage. Both sides' pools must agree
once the layouts are accounted for (:func:`state_mismatches`). Recurrent slots and index pages
move through their ``[regions, items, item_elems]`` views (:func:`kv.state_pools.items_view`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import Any

import torch

from kv.layouts import SlicePlan
from kv.local_copy import copy_to_rank
from kv.pool import KVPool
from kv.routes import SenderDuty
from kv.state_pools import IndexPool, RecurrentPool, StateKind, StatePools, items_view
from kv.state_routes import KV_POOLS, StateDuty, StateShare, decode_shape, state_duty
from kv.state_shapes import shape_mismatches

State = Mapping[StateKind, Sequence[int]]
AnyPool = KVPool | RecurrentPool | IndexPool


def state_mismatches(src: StatePools, dst: StatePools, plan: SlicePlan | None = None) -> list[str]:
    """``"name: prefill vs decode"`` for every state pool the two sides disagree on (presence,
    regions, item size, dtype, layout) and the window; empty when state can move between them
    (:func:`kv.state_shapes.shape_mismatches`). With the ``plan`` between two ranks of other
    layouts (TP sizes, a prefill stage's layers), the prefill pool is compared as the decode
    rank would hold it (:func:`kv.state_routes.decode_shape`)."""
    mine, theirs = src.shapes(), dst.shapes()
    out = []
    if plan is not None:
        held, total = src.stage_layers(), dst.stage_layers()
        for name, layers in held.items():
            every = total.get(name, range(layers.stop))
            if layers.stop > len(every):
                out.append(f"{name} layers: prefill {layers.start}..{layers.stop} vs decode "
                           f"{len(every)}")
            mine[name] = decode_shape(mine[name], name, layers, len(every), plan)
        for side, pools, heads in (("prefill", src, plan.prefill.heads_per_rank),
                                   ("decode", dst, plan.decode.heads_per_rank)):
            for name, pool in pools.named_pools().items():
                if name in KV_POOLS and isinstance(pool, KVPool) and pool.kv_heads != heads:
                    out.append(f"{side} {name} kv_heads: pool {pool.kv_heads} vs layout {heads}")
    return shape_mismatches(mine, theirs, src.window, dst.window) + out


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


def _items(share: StateShare, last: bool, src_pages: list[int], dst_pages: list[int],
           src_state: State, dst_state: State) -> tuple[list[int], list[int]] | None:
    """The items ``share`` moves with this chunk (None: nothing now)."""
    if share.name == "draft":
        return src_pages, dst_pages
    kind = StateKind(share.name)
    if not last or kind not in src_state:
        return None
    return list(src_state[kind]), list(dst_state[kind])


def copy_share(a: AnyPool, b: AnyPool, share: StateShare, src_items: list[int],
               dst_items: list[int]) -> int:
    """Copy ``share`` of items ``src_items`` of ``a`` into ``dst_items`` of ``b``; the bytes
    moved."""
    if not src_items:
        return 0
    if isinstance(a, KVPool) and isinstance(b, KVPool):
        return copy_to_rank(a, b, src_items, dst_items, share.heads, share.layers,
                            whole=share.whole)
    src_view, dst_view = items_view(a), items_view(b)[share.layers.start : share.layers.stop]
    if share.name == "recurrent":
        src_view = src_view[:, :, share.src_cols.start : share.src_cols.stop]
        dst_view = dst_view[:, :, share.dst_cols.start : share.dst_cols.stop]
    index = torch.tensor(src_items, dtype=torch.long, device=src_view.device)
    rows = src_view.index_select(1, index).to(dst_view.device)
    dst_view.index_copy_(1, index.new_tensor(dst_items).to(dst_view.device), rows)
    return rows.numel() * rows.element_size()


def owed_state(states: StatePools | None, duty: SenderDuty) -> StateDuty:
    """What a prefill rank holding ``states`` owes of them where it owes ``duty`` of its
    pages (:func:`kv.state_routes.state_duty`)."""
    if states is None:
        return state_duty(duty, {})
    return state_duty(duty, states.stage_layers(), states.recurrent_width)


def move_state(src: StatePools | None, dst: StatePools | None, shares: Sequence[StateShare], *,
               src_pages: list[int], dst_pages: list[int], last: bool, src_state: State,
               dst_state: State) -> int:
    """What a chunk moves into one decode rank besides the full pool's pages: ``shares``
    (:meth:`kv.state_routes.StateDuty.shares`) of the draft's copies of its pages, and on the
    ``last`` chunk of the state; the bytes moved. ValueError when the receiving side has no
    state pools or the state sent does not pair with the destination's."""
    if src is None or (src.draft is None and not src_state):
        return 0
    if dst is None:
        raise ValueError("the decode side has no state pools for this model's state")
    why = pairing(src_state, dst_state) if last else ""
    if why:
        raise ValueError(why)
    moved = 0
    for share in shares:
        items = _items(share, last, src_pages, dst_pages, src_state, dst_state)
        if items is not None:
            a, b = src.named_pools()[share.name], dst.named_pools()[share.name]
            moved += copy_share(a, b, share, *items)
    return moved
