"""The hybrid-state parts of the control messages (:mod:`kv.wire`): where a decode rank's state
pools lie (in its ``Register``) and where a room's state goes (in its ``Destination``).

A decode rank with state pools (:mod:`kv.state_pools`) registers each of them with its engine
and names them in its ``Register``: per pool (``draft``, ``swa``, ``recurrent``, ``index``) its
shape (:class:`~kv.state_shapes.StateShape`: regions, items, item bytes, dtype, layout) and the
address of each region, plus the sliding window (0 without an SWA pool). Item ``i`` of region
``r`` lies at ``ptrs[r] + i * item_len``. Per room its ``Destination`` names the items each
state kind goes to; the draft pool's pages are the room's destination pages (the draft shares
the full pool's page indices), so they travel once.

Every field is checked like the others (:mod:`kv.wire_fields`): known pool names and fields
only, packed arrays within their limits, a dtype and layout from the known sets, regions that
fit the address space, a draft pool with as many pages as the full pool, a window exactly when
there is an SWA pool. :func:`check_state_items` checks a destination's items against the pools
its session registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from kv.pool_layout import KV_LAYOUTS
from kv.state_shapes import POOL_NAMES, STATE_KINDS, StateShape
from kv.wire_fields import MAX_U64, WireError, int_field, packed_field, str_field

MAX_REGIONS = 1 << 12
MAX_ITEMS = 1 << 24
#: The dtypes a state pool may hold (torch's names without ``torch.``).
STATE_DTYPES = frozenset({"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                          "float64", "int64", "int32", "int16", "int8", "uint8"})
_POOL_FIELDS = {"ptrs", "items", "item_len", "dtype", "layout"}


@attrs.frozen
class PoolMemory:
    """One registered pool of a decode rank: its name, shape and each region's address."""

    name: str
    shape: StateShape
    ptrs: tuple[int, ...]


def encode_pools(pools: tuple[PoolMemory, ...]) -> dict[str, Any]:
    return {
        p.name: {
            "ptrs": np.asarray(p.ptrs, dtype="<u8").tobytes(),
            "items": p.shape.items,
            "item_len": p.shape.item_len,
            "dtype": p.shape.dtype,
            "layout": p.shape.layout,
        }
        for p in pools
    }


def encode_items(state: Mapping[str, np.ndarray]) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v, dtype="<i4").tobytes() for k, v in state.items()}


def _map(body: dict[Any, Any], name: str, allowed: tuple[str, ...] | set[str]) -> dict[Any, Any]:
    value = body.get(name)
    if not isinstance(value, dict):
        raise WireError("bad_field", f"{name}: expected a map, got {type(value).__name__}")
    extra = set(value) - set(allowed)
    if extra:
        raise WireError("bad_field", f"{name}: unexpected keys {sorted(map(str, extra))}")
    return value


def parse_pools(body: dict[Any, Any], num_pages: int) -> tuple[tuple[PoolMemory, ...], int]:
    """A ``Register``'s ``state_pools`` and ``state_window``."""
    raw = _map(body, "state_pools", POOL_NAMES)
    pools = []
    for name in POOL_NAMES:
        if name not in raw:
            continue
        entry = _map(raw, name, _POOL_FIELDS)
        if set(entry) != _POOL_FIELDS:
            raise WireError("bad_field", f"state_pools.{name}: needs {sorted(_POOL_FIELDS)}")
        where = f"state_pools.{name}"
        ptrs = packed_field(entry, "ptrs", "<u8", MAX_REGIONS)
        shape = StateShape(
            regions=len(ptrs),
            items=int_field(entry, "items", 1, MAX_ITEMS),
            item_len=int_field(entry, "item_len", 1, 1 << 32),
            dtype=str_field(entry, "dtype"),
            layout=str_field(entry, "layout", allow_empty=True),
        )
        if not len(ptrs) or int(ptrs.min()) < 1:
            raise WireError("bad_field", f"{where}.ptrs: expected 1..{MAX_REGIONS} addresses")
        if int(ptrs.max()) + shape.items * shape.item_len > MAX_U64:
            raise WireError("bad_field", f"{where}: a region would extend past the address space")
        if shape.dtype not in STATE_DTYPES:
            raise WireError("bad_field", f"{where}.dtype: {shape.dtype!r} not one of "
                                         f"{sorted(STATE_DTYPES)}")
        if shape.layout and shape.layout not in KV_LAYOUTS:
            raise WireError("bad_field", f"{where}.layout: {shape.layout!r} not one of "
                                         f"{list(KV_LAYOUTS)}")
        if name == "draft" and shape.items != num_pages:
            raise WireError("bad_field", f"{where}: {shape.items} pages, the full pool has "
                                         f"{num_pages} (the draft shares its page indices)")
        pools.append(PoolMemory(name, shape, tuple(int(p) for p in ptrs)))
    window = int_field(body, "state_window", 0, MAX_ITEMS)
    if bool(window) != ("swa" in raw):
        raise WireError("bad_field", f"state_window: {window}, but "
                                     f"{'an' if 'swa' in raw else 'no'} swa pool")
    return tuple(pools), window


def parse_items(body: dict[Any, Any]) -> dict[str, np.ndarray]:
    """A ``Destination``'s ``state``: the items of each state kind."""
    raw = _map(body, "state", STATE_KINDS)
    return {kind: packed_field(raw, kind, "<i4", MAX_ITEMS) for kind in STATE_KINDS
            if kind in raw}


def check_state_items(room: int, state: Mapping[str, np.ndarray],
                      pools: tuple[PoolMemory, ...]) -> None:
    """Raise ``WireError`` unless every kind of ``state`` has a registered pool and every item
    lies inside it."""
    registered = {p.name: p for p in pools}
    for kind, items in state.items():
        pool = registered.get(kind)
        if pool is None:
            raise WireError("unknown_state", f"room {room}: no {kind} pool was registered")
        count = pool.shape.items
        if len(items) and (int(items.min()) < 0 or int(items.max()) >= count):
            raise WireError("state_out_of_range", f"room {room}: {kind} items must lie in "
                                                  f"0..{count - 1}, got "
                                                  f"{int(items.min())}..{int(items.max())}")
