"""Engine blocks for a sliced send: which bytes of a prefill rank's pool go where in a decode
rank's pool, for head slices and pipeline stages, in either pool layout.

Theory of operation
-------------------
A Mooncake write is a list of blocks ``(source address, destination address, length)``, each
contiguous on both sides. What one prefill rank sends one decode rank is, for every run of
pages consecutive on both sides (:func:`kv.pages.coalesce`), every head slice
(:class:`kv.layouts.HeadSlice`) and every layer both pools hold, the slice's heads of every
token slot, K and V. Seen as tensors that is a sub-array of each pool with the dimensions
pages, layers, K/V, token slots, heads and head bytes; each dimension has a byte stride on
either side (:class:`PoolShape`, from the pool's layout: :mod:`kv.pool_layout`).

:func:`slice_blocks` walks those dimensions from the innermost outwards (in the source pool's
memory order) and merges a dimension into the block while it is contiguous on *both* sides,
that is while its stride on each side equals the bytes merged so far; the first dimension that
is not ends the block, and every dimension outside it is enumerated. What comes out is the
fewest blocks the two layouts allow, without a case per layout:

- whole pages on both sides (the same heads per rank, one slice of all of them) and every
  layer: one block per run page-major, one per run and layer half layer-major, as
  :mod:`kv.mooncake_writes` writes unsliced;
- a stage's layers into a decode pool that holds more: page-major, one block per page (the
  stage's layers of a page are contiguous, the pages are not); layer-major, unchanged;
- a head slice that is not every head of both pages: one block per token slot, layer half and
  page (SGLang's slice send), since the slice's heads of consecutive slots are apart.

The pages dimension merges only into the innermost block (a run's length differs from run to
run); when it does, a block spans a whole run. Offsets are bytes from the start of each pool's
buffer; the caller adds the base addresses and cuts long blocks (:func:`kv.mooncake_writes.
cut_blocks`). Pure arithmetic on numpy arrays: no engine, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from kv import wire
from kv.layouts import HeadSlice, LayoutError
from kv.mooncake_state import (
    NO_STATE,
    StateTarget,
    column_blocks,
    decode_layers,
    item_blocks,
    state_target,
)
from kv.pages import Run, coalesce
from kv.pool import KVPool
from kv.pool_layout import KVLayout, parse_kv_layout
from kv.rank_table import RankPlace
from kv.routes import sender_duty
from kv.state_pools import StatePools
from kv.state_routes import KV_POOLS
from kv.wire_state import PoolMemory

# Dimension names in the order of a pool's tensor, per layout ("B" is the bytes of one head).
_ORDER = {
    KVLayout.LAYER_MAJOR: ("L", "KV", "P", "S", "H", "B"),
    KVLayout.PAGE_MAJOR: ("P", "L", "KV", "S", "H", "B"),
}

Blocks = tuple[np.ndarray, np.ndarray, np.ndarray]  # source offsets, destination offsets, lengths


@attrs.frozen
class PoolShape:
    """What :func:`slice_blocks` needs of one side's pool: its order and sizes, and which model
    layer its layer 0 holds (a pipeline stage's pool holds the layers from ``first_layer``)."""

    layout: KVLayout = attrs.field(converter=parse_kv_layout)
    num_layers: int = attrs.field(validator=attrs.validators.ge(1))
    num_pages: int = attrs.field(validator=attrs.validators.ge(1))
    page_size: int = attrs.field(validator=attrs.validators.ge(1))
    kv_heads: int = attrs.field(validator=attrs.validators.ge(1))
    #: Bytes of one head of one token slot (``head_dim`` x the element size).
    head_bytes: int = attrs.field(validator=attrs.validators.ge(1))
    first_layer: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @classmethod
    def of(cls, pool: KVPool, *, first_layer: int = 0) -> PoolShape:
        return cls(layout=pool.layout, num_layers=pool.num_layers, num_pages=pool.num_pages,
                   page_size=pool.page_size, kv_heads=pool.kv_heads,
                   head_bytes=pool.head_dim * pool.buffer.element_size(),
                   first_layer=first_layer)

    @property
    def layers(self) -> range:
        """The model layers this pool holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    def strides(self) -> dict[str, int]:
        """Byte stride of every dimension of the pool's tensor."""
        sizes = {"L": self.num_layers, "KV": 2, "P": self.num_pages, "S": self.page_size,
                 "H": self.kv_heads, "B": self.head_bytes}
        out: dict[str, int] = {}
        stride = 1
        for dim in reversed(_ORDER[self.layout]):
            out[dim] = stride
            stride *= sizes[dim]
        return out


def slice_blocks(
    src: PoolShape, dst: PoolShape, runs: Sequence[Run], slices: Sequence[HeadSlice]
) -> Blocks:
    """The blocks that write, for every run and slice, the slice's heads of the layers both
    pools hold from ``src`` into ``dst`` (byte offsets from each buffer's start).

    ``slices`` are what one prefill rank writes into one decode rank
    (:meth:`kv.layouts.SlicePlan.between`). Raises ValueError when the pools' head bytes or page
    sizes differ, or a slice or run falls outside a pool.
    """
    if (src.page_size, src.head_bytes) != (dst.page_size, dst.head_bytes):
        raise ValueError(
            f"pools disagree: page_size {src.page_size} vs {dst.page_size}, head bytes "
            f"{src.head_bytes} vs {dst.head_bytes}"
        )
    layers = range(max(src.layers.start, dst.layers.start), min(src.layers.stop, dst.layers.stop))
    empty = np.zeros(0, dtype=np.int64)
    if not runs or not slices or not layers:
        return empty, empty, empty
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if (r[:, 0].min() < 0 or r[:, 1].min() < 0 or (r[:, 0] + r[:, 2]).max() > src.num_pages
            or (r[:, 1] + r[:, 2]).max() > dst.num_pages):
        raise ValueError("a run of pages lies outside a pool")
    parts = [_one_slice(src, dst, r, s, layers) for s in slices]
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]))


def _one_slice(src: PoolShape, dst: PoolShape, runs: np.ndarray, s: HeadSlice,
               layers: range) -> Blocks:
    if s.src_heads.stop > src.kv_heads or s.dst_heads.stop > dst.kv_heads:
        raise ValueError(f"slice {s} reaches past the pools' heads (prefill {src.kv_heads}, "
                         f"decode {dst.kv_heads})")
    ss, ds = src.strides(), dst.strides()
    count = {"L": len(layers), "KV": 2, "S": src.page_size, "H": len(s.src_heads),
             "B": src.head_bytes}
    # Where the sub-array starts on each side, pages aside.
    src_base = ((layers.start - src.first_layer) * ss["L"] + s.src_heads.start * ss["H"])
    dst_base = ((layers.start - dst.first_layer) * ds["L"] + s.dst_heads.start * ds["H"])
    block = 1
    pages_in_block = False
    outer: list[str] = []
    closed = False  # a dimension ended the block (a run's pages end it too)
    for dim in reversed(_ORDER[src.layout]):
        if dim == "P":
            pages_in_block = not closed and ss["P"] == block and ds["P"] == block
            closed = True
        elif not closed and (count[dim] == 1 or (ss[dim] == block and ds[dim] == block)):
            block *= count[dim]
        else:
            closed = True
            outer.append(dim)
    # Offsets of the blocks within one page (or run): every index of every outer dimension.
    src_in = np.zeros(1, dtype=np.int64)
    dst_in = np.zeros(1, dtype=np.int64)
    for dim in reversed(outer):  # the outermost varies slowest
        if count[dim] == 1:
            continue
        idx = np.arange(count[dim], dtype=np.int64)
        src_in = (src_in[:, None] + idx * ss[dim]).ravel()
        dst_in = (dst_in[:, None] + idx * ds[dim]).ravel()
    if pages_in_block:
        src_at, dst_at, lens = runs[:, 0], runs[:, 1], runs[:, 2] * block
    else:  # every page of every run on its own
        pages = np.arange(int(runs[:, 2].sum()), dtype=np.int64)
        first = np.repeat(np.cumsum(runs[:, 2]) - runs[:, 2], runs[:, 2])
        within = pages - first
        src_at = np.repeat(runs[:, 0], runs[:, 2]) + within
        dst_at = np.repeat(runs[:, 1], runs[:, 2]) + within
        lens = np.full(len(pages), block, dtype=np.int64)
    # Pages outermost in the source order: page (or run) major; else the rest first, as the
    # unsliced writer goes region by region.
    src_off = src_base + src_at * ss["P"]
    dst_off = dst_base + dst_at * ds["P"]
    if _ORDER[src.layout][0] == "P":
        return ((src_off[:, None] + src_in).ravel(), (dst_off[:, None] + dst_in).ravel(),
                np.repeat(lens, len(src_in)))
    return ((src_in[:, None] + src_off).ravel(), (dst_in[:, None] + dst_off).ravel(),
            np.tile(lens, len(src_in)))


@attrs.frozen(eq=False)
class Target:
    """What this prefill rank writes into one registered decode rank (its session): the head
    slices, both pools' shapes, which decode ranks' destinations a room waits for, and whether
    it writes the metadata row (the lowest source of the stage that holds the last layer, the
    one that computes the first token, does); and what it writes into the decode rank's state
    pools (:mod:`kv.mooncake_state`)."""

    reg: wire.Register
    slices: tuple[HeadSlice, ...]
    waits_for: tuple[int, ...]
    src: PoolShape
    dst: PoolShape
    rows: bool
    state: StateTarget = NO_STATE
    #: The draft's and the SWA pool's shapes on both sides, for their head slices.
    state_kv: Mapping[str, tuple[PoolShape, PoolShape]] = attrs.field(factory=dict)

    @property
    def decode_rank(self) -> int:
        return self.reg.tp_rank


def target_of(pool: KVPool, place: RankPlace, reg: wire.Register,
              states: StatePools | None = None, memory: tuple[PoolMemory, ...] = ()) -> Target:
    """The target a decode registration describes, for the prefill rank at ``place`` with
    ``pool`` (and ``states`` beside it, described by ``memory``:
    :func:`kv.mooncake_state.state_target`); raises :class:`~kv.wire.WireError`
    (``incompatible_layout``) naming both sides' values when the two cannot exchange KV."""
    mine = {"head_dim": pool.head_dim, "kv_heads": place.kv_heads, "mla": place.mla,
            "layers": place.num_layers}
    theirs = {"head_dim": reg.head_dim, "kv_heads": reg.kv_heads, "mla": reg.mla,
              "layers": reg.num_layers}
    problem = ""
    if mine != theirs:
        problem = f"(head_dim, model kv_heads, mla, layers) {theirs} differ from this rank's {mine}"
    else:
        decode = RankPlace(tp_rank=reg.tp_rank, tp_size=reg.tp_size, kv_heads=reg.kv_heads,
                           mla=reg.mla, num_layers=reg.num_layers, layer_start=0,
                           layer_stop=reg.num_layers)
        try:
            duty = sender_duty(place, decode)
        except (LayoutError, ValueError) as exc:
            problem = str(exc)
        else:
            heads = decode.heads_per_rank
            want = pool.page_size * heads * pool.head_dim * pool.buffer.element_size()
            if reg.page_bytes != want:
                problem = (f"page_bytes {reg.page_bytes}, but {heads} heads per decode rank "
                           f"make {want}")
    if problem:
        raise wire.WireError("incompatible_layout", f"session {reg.session}: {problem}")
    head_bytes = pool.head_dim * pool.buffer.element_size()
    state = state_target(states, memory, duty, reg)
    state_kv: dict[str, tuple[PoolShape, PoolShape]] = {}
    if states is not None and not state.refused:
        held = states.stage_layers()
        for name, pool_kv in states.named_pools().items():
            if name in KV_POOLS and name in state.shares and isinstance(pool_kv, KVPool):
                ours, dest = state.pools[name]
                state_kv[name] = (
                    PoolShape.of(pool_kv, first_layer=held[name].start),
                    PoolShape(layout=dest.shape.layout, num_pages=dest.shape.items,
                              num_layers=decode_layers(name, ours.shape, dest.shape,
                                                       held[name], duty.plan),
                              page_size=reg.page_size, kv_heads=decode.heads_per_rank,
                              head_bytes=pool_kv.head_dim * pool_kv.buffer.element_size()))
    return Target(
        reg=reg,
        slices=duty.slices(reg.tp_rank),
        waits_for=duty.destinations,
        src=PoolShape.of(pool, first_layer=place.layer_start),
        dst=PoolShape(layout=reg.kv_layout, num_layers=reg.num_layers, num_pages=reg.num_pages,
                      page_size=reg.page_size, kv_heads=decode.heads_per_rank,
                      head_bytes=head_bytes),
        rows=(place.layer_stop == place.num_layers
              and duty.plan.sources(reg.tp_rank)[0] == place.tp_rank),
        state=state, state_kv=state_kv,
    )


def state_blocks(target: Target, name: str, src_items: Sequence[int],
                 dst_items: Sequence[int]) -> Blocks:
    """The blocks (addresses) that write this rank's share of items ``src_items`` of its pool
    ``name`` into items ``dst_items`` of the target's (none without a share): a KV pool's head
    slices, a recurrent slot's channels, whole index pages, each into the decode pool's layers
    of this rank's stage."""
    share = target.state.shares.get(name)
    if share is None or not src_items:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    mine, theirs = target.state.pools[name]
    if name in target.state_kv:
        src_shape, dst_shape = target.state_kv[name]
        src, dst, lens = slice_blocks(src_shape, dst_shape, coalesce(src_items, dst_items),
                                      share.heads)
        return src + mine.ptrs[0], dst + theirs.ptrs[0], lens
    if name == "recurrent":
        return column_blocks(mine, theirs, share, list(zip(src_items, dst_items, strict=True)),
                             target.state.recurrent_elem)
    return item_blocks(mine, theirs, coalesce(src_items, dst_items), share.layers.start)
