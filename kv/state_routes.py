"""Who sends which bytes of a hybrid model's state pools (:mod:`kv.state_pools`) to whom when
the prefill and the decode side run different parallel layouts.

Theory of operation
-------------------
The full-attention pages go by :class:`~kv.routes.SenderDuty`: a prefill TP rank writes its head
slices (:class:`~kv.layouts.SlicePlan`) of its pipeline stage's layers into the same layers of
the decode rank. Each pool beside it follows the rule its contents dictate:

``draft`` and ``swa``
    KV pages (a draft model's, the sliding-window layers'), holding per rank the same KV heads
    as the full pool (the draft's shape is the target's, its layers truncated; SWA layers are
    attention layers of the same model): the same head slices as the full pages, of the
    stage's layers of that pool. The draft goes with every chunk's pages, the SWA window with
    the last chunk.
``recurrent``
    One state vector per layer and request. A recurrent layer's input projection is the
    attention's query projection and its output the attention's output projection
    (``scheduler/model/decoder.py``), and a TP rank holds the query heads
    ``t*H/T .. (t+1)*H/T`` with their rows of that projection (``scheduler/model/sharded.py``),
    so it computes, channel by channel, the same ``1/T`` of the state: TP rank ``t`` holds
    channels ``[t*W/T, (t+1)*W/T)`` of the ``W``-channel state, whatever the KV heads (no
    replication: query heads always split). A prefill rank writes to a decode rank the channels
    both hold; with TP sizes that divide one another those are exactly the decode rank's
    :meth:`~kv.layouts.SlicePlan.contacts`, so a prefill rank that is status-only for the KV
    pages (a GQA replica no one takes its head from, an MLA rank other than the first) still
    writes its channels, and a decode rank waits for every contact
    (:func:`state_sources`).
``index`` (NSA-style)
    One key vector per token and layer, which every TP rank of an NSA model holds whole (like
    an MLA latent): per decode rank one prefill rank of each stage writes it, the lowest of that
    decode rank's KV sources (so the index adds no source).

With pipeline stages each pool's layers split like the model's: a stage holds the pool layers
of its model layers (``StatePools(..., stage=)``), written into the same layers of the decode
rank's pool (a decode rank holds every layer).

:func:`state_duty` is the whole rule, on the prefill side; :func:`state_sources` is the decode
side's count of whom a room waits for. Both backends use them. Arithmetic only: no torch, no
I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from kv.layouts import HeadSlice, LayoutError, SlicePlan
from kv.routes import SenderDuty
from kv.state_shapes import StateShape

#: The pools that are KV pages sliced by heads like the full pool.
KV_POOLS = ("draft", "swa")


@attrs.frozen
class StateShare:
    """What one prefill rank writes of one pool (``name``) into one decode rank, per item: its
    layers land in the decode pool's ``layers``; a KV pool's ``heads`` (whole pages when
    ``whole``), a recurrent slot's channels ``src_cols`` into ``dst_cols``, an index page whole."""

    name: str
    layers: range
    heads: tuple[HeadSlice, ...] = ()
    whole: bool = False
    src_cols: range = range(0)
    dst_cols: range = range(0)


@attrs.frozen
class StateDuty:
    """What one prefill rank owes each decode rank of every pool beside the full one."""

    duty: SenderDuty
    #: Each pool's layers this rank's stage holds (the decode pool's layers they land in).
    layers: Mapping[str, range] = attrs.field(factory=dict)
    #: The recurrent state's channels this rank holds (0 without a recurrent pool).
    recurrent_width: int = 0

    def shares(self, decode_rank: int) -> tuple[StateShare, ...]:
        """Everything this rank writes beside the full pages into ``decode_rank`` (empty for a
        decode rank it does not write to)."""
        plan, p = self.duty.plan, self.duty.prefill_rank
        if decode_rank not in self.duty.destinations:
            return ()
        out = []
        for name, layers in self.layers.items():
            if name in KV_POOLS:
                heads = self.duty.slices(decode_rank)
                if heads:
                    out.append(StateShare(name, layers, heads=heads,
                                          whole=self.duty.whole_pages(decode_rank)))
            elif name == "recurrent":
                src, dst = recurrent_cols(plan, p, decode_rank, self.recurrent_width)
                if len(src):
                    out.append(StateShare(name, layers, src_cols=src, dst_cols=dst))
            elif name == "index":
                if plan.sources(decode_rank)[:1] == (p,):
                    out.append(StateShare(name, layers))
            else:
                raise AssertionError(f"unknown state pool {name!r}")
        return tuple(out)

    @property
    def status_only(self) -> bool:
        """This rank writes nothing to anyone: no full pages and no state."""
        return self.duty.status_only and not any(self.shares(d) for d in self.duty.destinations)


def recurrent_cols(plan: SlicePlan, prefill_rank: int, decode_rank: int,
                   width: int) -> tuple[range, range]:
    """The recurrent channels ``prefill_rank`` (holding ``width`` of them) writes into
    ``decode_rank``: where they sit in the prefill rank's state and in the decode rank's (empty
    ranges when the two hold none in common). :class:`LayoutError` when the state does not
    split evenly over the decode side's ranks."""
    tp, td = plan.prefill.tp_size, plan.decode.tp_size
    total = width * tp
    if width <= 0 or total % td:
        raise LayoutError(f"a recurrent state of {total} channels ({width} on each of {tp} "
                          f"prefill ranks) does not split over {td} decode ranks")
    per_decode = total // td
    src0, dst0 = prefill_rank * width, decode_rank * per_decode
    lo, hi = max(src0, dst0), min(src0 + width, dst0 + per_decode)
    if lo >= hi:
        return range(0), range(0)
    return range(lo - src0, hi - src0), range(lo - dst0, hi - dst0)


def state_duty(duty: SenderDuty, layers: Mapping[str, range],
               recurrent_width: int = 0) -> StateDuty:
    """The state a prefill rank with ``duty`` for the full pages owes, holding the pools named
    in ``layers`` (each with the layers its stage holds of that pool) and ``recurrent_width``
    channels of a recurrent state."""
    if "recurrent" in layers and recurrent_width <= 0:
        raise ValueError(f"a recurrent pool needs its width, got {recurrent_width}")
    return StateDuty(duty, dict(layers), recurrent_width)


def state_sources(plan: SlicePlan, decode_rank: int, names: Collection[str]) -> tuple[int, ...]:
    """The TP ranks of each prefill stage whose success a decode rank's room waits for when
    both sides hold the pools ``names``: the full pages' sources, and with a recurrent state
    every contact (each holds some of its channels)."""
    if "recurrent" in names:
        return plan.contacts(decode_rank)
    return plan.sources(decode_rank)


def decode_shape(shape: StateShape, name: str, held: range, layers: int,
                 plan: SlicePlan) -> StateShape:
    """``shape`` (a prefill rank's pool ``name``, holding the pool layers ``held``) as a decode
    rank of ``plan`` holding every one of ``layers`` layers would hold it: what the decode
    rank's pool must be for :func:`state_duty`'s shares to land (equal to ``shape`` between
    equal layouts)."""
    regions, item_len = shape.regions, shape.item_len
    stage = len(held)
    if name in KV_POOLS:
        item_len = item_len // plan.prefill.heads_per_rank * plan.decode.heads_per_rank
        if shape.layout == "page_major":
            item_len = item_len // stage * layers
        else:
            regions = regions // stage * layers
    else:
        regions = layers
        if name == "recurrent":
            item_len = item_len * plan.prefill.tp_size // plan.decode.tp_size
    return attrs.evolve(shape, regions=regions, item_len=item_len)


def stage_gaps(stages: Sequence[Mapping[str, range]], decode: Mapping[str, range]) -> list[str]:
    """For each pool of ``decode`` (a decode rank's pools, by the layers each holds), a line
    when the prefill ``stages`` (each stage's layers of each pool) do not hold its layers
    exactly once, in order; empty when they do. A prefill side of one stage is worded as
    :func:`kv.state_copy.state_mismatches` words the other direction (``"draft layers:
    prefill 0..1 vs decode 2"``): there are no stages to speak of."""
    out = []
    for name, every in decode.items():
        held = sorted((s[name] for s in stages if name in s), key=lambda r: r.start)
        if [i for r in held for i in r] != list(every):
            spans = ", ".join(f"{r.start}..{r.stop}" for r in held) or "none"
            out.append(f"{name} layers: prefill {spans} vs decode {len(every)}"
                       if len(stages) <= 1 else
                       f"{name} layers: the prefill stages hold {spans} of the decode's "
                       f"{len(every)}")
    return out
