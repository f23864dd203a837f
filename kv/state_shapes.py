"""What two sides must agree on to move a hybrid model's state pools (:mod:`kv.state_pools`)
between them, as plain records a control message can carry.

Every pool beside the full-attention one (the draft model's KV, and the state of each
:class:`~kv.state_pools.StateKind`) reads as ``[regions, items, item bytes]``
(:func:`kv.state_pools.items_view`). Items move whole, so both sides must hold the same pools
with the same regions, item size, dtype and (for a KV pool) layout, and the same sliding window;
how many items each side holds may differ. :func:`shape_mismatches` names every disagreement,
both sides' values, in one wording for every backend. Pure records: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

#: The pools a side may hold beside its full-attention pool, in the order messages name them:
#: the draft model's KV, then each state kind (``kv.state_pools.StateKind`` values).
POOL_NAMES = ("draft", "swa", "recurrent", "index")
STATE_KINDS = POOL_NAMES[1:]


@attrs.frozen
class StateShape:
    """One pool as ``[regions, items, item_len bytes]`` of ``dtype`` (torch's name without
    ``torch.``); ``layout`` is a KV pool's order (:mod:`kv.pool_layout`), empty for others."""

    regions: int
    items: int
    item_len: int
    dtype: str
    layout: str = ""

    def describe(self) -> str:
        """What must match, in words (the item count may differ)."""
        extra = f", {self.layout}" if self.layout else ""
        return f"{self.regions} regions of {self.item_len}-byte {self.dtype} items{extra}"


def shape_mismatches(
    prefill: Mapping[str, StateShape],
    decode: Mapping[str, StateShape],
    prefill_window: int | None,
    decode_window: int | None,
) -> list[str]:
    """``"name: prefill vs decode"`` for every pool the two sides disagree on (a missing pool
    reads ``none``), and the sliding window; empty when state can move between them."""
    out = []
    for name in POOL_NAMES:
        a, b = prefill.get(name), decode.get(name)
        mine = "none" if a is None else a.describe()
        theirs = "none" if b is None else b.describe()
        if mine != theirs:
            out.append(f"{name}: {mine} vs {theirs}")
    if prefill_window != decode_window:
        out.append(f"swa window: {prefill_window} vs {decode_window}")
    return out
