"""How a KV pool orders its tensor: layer-major or page-major.

Theory of operation
-------------------
A pool holds, for every layer and for K and V, ``pages x page_size x kv_heads x head_dim``
elements. Two orders of the same elements are supported:

``layer_major``: ``[layers, 2 (K, V), pages, page_size, kv_heads, head_dim]``
    SGLang's order of its pool's tensors. One page of one layer half is
    contiguous and a run of consecutive pages is contiguous *within* a layer half, so moving a
    run touches ``2 x layers`` regions (one engine block each).
``page_major``: ``[pages, layers, 2 (K, V), page_size, kv_heads, head_dim]``
    One page holds the K and V of every layer, so a run of consecutive pages is one contiguous
    region: one engine block, whatever the number of layers. The model reads each layer through
    strided views.

Both sides of a transfer must use the same order (the registration carries it and a mismatch is
refused). This module is arithmetic only, with no torch, so the wire and bootstrap layers can
name a layout without loading it; :mod:`kv.pool` builds the tensors.
"""

from __future__ import annotations

import enum


class KVLayout(enum.StrEnum):
    """The order of a pool's tensor (see the module's docstring)."""

    LAYER_MAJOR = "layer_major"
    PAGE_MAJOR = "page_major"

    def regions(self, num_layers: int) -> int:
        """The contiguous regions a run of consecutive pages occupies: one per layer half
        (layer-major), or one (page-major)."""
        return 2 * num_layers if self is KVLayout.LAYER_MAJOR else 1

    def shape(
        self, *, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The pool tensor's shape in this layout."""
        page = (page_size, kv_heads, head_dim)
        if self is KVLayout.LAYER_MAJOR:
            return (num_layers, 2, num_pages, *page)
        return (num_pages, num_layers, 2, *page)


def parse_kv_layout(value: str | KVLayout) -> KVLayout:
    """``value`` as a layout; ValueError naming the layouts there are (an attrs converter)."""
    try:
        return KVLayout(value)
    except ValueError:
        raise ValueError(
            f"kv layout must be one of {', '.join(KV_LAYOUTS)}, got {value!r}"
        ) from None


#: The layout names, in the order help texts list them.
KV_LAYOUTS = tuple(layout.value for layout in KVLayout)

#: The layout of both sides of a pdlife pair (``pdlife serve``, the embedded pair) unless told
#: otherwise: page-major, whose run of pages is one transfer block (docs/backends.md#pool-layouts).
#: A :class:`~kv.pool.KVPool` built without a layout is layer-major, SGLang's.
DEFAULT_KV_LAYOUT = KVLayout.PAGE_MAJOR
