"""Which KV heads go from which prefill TP rank to which decode TP rank.

Theory of operation. A model has ``kv_heads`` KV heads. Under tensor parallelism of size
``T`` each rank's pool holds some of them, in model order (:class:`TPLayout`):

- ``kv_heads >= T``: rank ``r`` holds the ``kv_heads / T`` heads from ``r * kv_heads / T``;
- ``kv_heads < T`` (GQA with fewer KV heads than ranks): every rank holds one head, each head
  replicated on ``T / kv_heads`` consecutive ranks: rank ``r`` holds head
  ``r // (T / kv_heads)``;
- MLA: the latent KV is not split; every rank holds all of it (``kv_heads`` is then the
  latent's head count, usually one).

Any other ratio is refused (:class:`LayoutError`), as SGLang refuses it.

A prefill at TP ``Tp`` feeds a decode at TP ``Td``. Every decode rank must end up with each
head it holds written exactly once. When a head has several holders on the prefill side
(replication, MLA) exactly one of them sends it to a given decode rank: the ``i``-th decode
holder of head ``h`` takes it from prefill holder ``i * |prefill holders| // |decode holders|``,
which spreads the decode holders evenly over the prefill replicas and picks SGLang's prefill
rank in every layout SGLang handles exactly (same TP, TP ``Tp > Td``, ``Tp < Td``, MLA). A
prefill rank with nothing to send to anyone only reports status, as SGLang's MLA "dummy" ranks
do: it learns the room from a decode rank so its poll converges, and marks its side done
without writing.

Who talks to whom follows SGLang's rank mapping (:meth:`SlicePlan.contacts`): with
``Tp >= Td`` decode rank ``d`` gives its destination to the ``Tp / Td`` prefill ranks from
``d * Tp / Td``; with ``Tp < Td`` to prefill rank ``d // (Td / Tp)``. Every sender of a
decode rank is among its contacts. Completion: a decode rank's room is complete when every
prefill rank that writes into it (:meth:`SlicePlan.sources`) reported success; a prefill rank
waits for the destinations of every decode rank that contacts it
(:meth:`SlicePlan.destinations`) before it leaves bootstrapping.

This module is arithmetic only: no torch, no I/O. :mod:`kv.slice_copy` moves the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs


class LayoutError(ValueError):
    """A TP size, rank or head count that no rank mapping can serve."""


@attrs.frozen
class TPLayout:
    """How one side's ranks split the model's KV heads."""

    tp_size: int
    kv_heads: int
    #: The KV is a latent every rank holds whole (DeepSeek-style MLA).
    mla: bool = False

    def __attrs_post_init__(self) -> None:
        if self.tp_size < 1:
            raise LayoutError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.kv_heads < 1:
            raise LayoutError(f"kv_heads must be >= 1, got {self.kv_heads}")
        if not self.mla and self.kv_heads % self.tp_size and self.tp_size % self.kv_heads:
            raise LayoutError(
                f"kv_heads {self.kv_heads} and tp_size {self.tp_size}: one must divide the "
                "other (the heads split evenly, or each head is replicated on as many ranks)"
            )

    @property
    def heads_per_rank(self) -> int:
        """KV heads in one rank's page (its pool's ``kv_heads``)."""
        if self.mla:
            return self.kv_heads
        return max(1, self.kv_heads // self.tp_size)

    def heads_of(self, rank: int) -> range:
        """The model heads rank ``rank`` holds, in the order of its page."""
        self.check_rank(rank)
        if self.mla:
            return range(self.kv_heads)
        if self.kv_heads >= self.tp_size:
            n = self.kv_heads // self.tp_size
            return range(rank * n, (rank + 1) * n)
        head = rank // (self.tp_size // self.kv_heads)
        return range(head, head + 1)

    def holders(self, head: int) -> range:
        """The ranks that hold model head ``head``, ascending."""
        if not 0 <= head < self.kv_heads:
            raise LayoutError(f"head {head} is not in the model (0..{self.kv_heads - 1})")
        if self.mla:
            return range(self.tp_size)
        if self.kv_heads >= self.tp_size:
            rank = head // (self.kv_heads // self.tp_size)
            return range(rank, rank + 1)
        replicas = self.tp_size // self.kv_heads
        return range(head * replicas, (head + 1) * replicas)

    def check_rank(self, rank: int) -> None:
        """Raise :class:`LayoutError` unless ``rank`` is one of this side's ranks."""
        if not 0 <= rank < self.tp_size:
            raise LayoutError(
                f"rank {rank} is not in TP size {self.tp_size} (0..{self.tp_size - 1})"
            )


@attrs.frozen
class HeadSlice:
    """Model heads ``heads`` go from ``prefill_rank``'s page (at ``src_heads``) to
    ``decode_rank``'s page (at ``dst_heads``), in every layer, K and V, of every page sent."""

    prefill_rank: int
    decode_rank: int
    heads: range
    src_heads: range
    dst_heads: range


def _slices(pairs: list[tuple[int, int]], prefill: TPLayout, decode: TPLayout,
            p: int, d: int) -> Iterator[HeadSlice]:
    """Group ``(model head, chosen source)`` pairs sent from ``p`` to ``d`` into runs of heads
    consecutive on both pages."""
    src0, dst0 = prefill.heads_of(p).start, decode.heads_of(d).start
    heads = sorted(h for h, src in pairs if src == p)
    start = 0
    for i in range(1, len(heads) + 1):
        if i == len(heads) or heads[i] != heads[i - 1] + 1:
            run = range(heads[start], heads[i - 1] + 1)
            yield HeadSlice(
                prefill_rank=p, decode_rank=d, heads=run,
                src_heads=range(run.start - src0, run.stop - src0),
                dst_heads=range(run.start - dst0, run.stop - dst0),
            )
            start = i


@attrs.frozen
class SlicePlan:
    """Every head slice between a prefill layout and a decode layout, and who waits for whom.

    Build with :func:`plan_slices`.
    """

    prefill: TPLayout
    decode: TPLayout
    slices: tuple[HeadSlice, ...]

    def sends(self, prefill_rank: int) -> tuple[HeadSlice, ...]:
        """What ``prefill_rank`` writes, by decode rank."""
        self.prefill.check_rank(prefill_rank)
        return tuple(s for s in self.slices if s.prefill_rank == prefill_rank)

    def receives(self, decode_rank: int) -> tuple[HeadSlice, ...]:
        """What lands in ``decode_rank``'s pool, by prefill rank."""
        self.decode.check_rank(decode_rank)
        return tuple(s for s in self.slices if s.decode_rank == decode_rank)

    def between(self, prefill_rank: int, decode_rank: int) -> tuple[HeadSlice, ...]:
        """What ``prefill_rank`` writes into ``decode_rank`` (empty when nothing)."""
        return tuple(s for s in self.sends(prefill_rank) if s.decode_rank == decode_rank)

    def sources(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks that write into ``decode_rank``: its room is complete once each
        of them reported success (their number is SGLang's ``required_prefill_response_num``)."""
        return tuple(sorted({s.prefill_rank for s in self.receives(decode_rank)}))

    def contacts(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks ``decode_rank`` gives its destination to: its sources, and the
        status-only ranks whose poll needs the room."""
        self.decode.check_rank(decode_rank)
        tp, td = self.prefill.tp_size, self.decode.tp_size
        if tp >= td:
            k = tp // td
            return tuple(range(decode_rank * k, (decode_rank + 1) * k))
        return (decode_rank // (td // tp),)

    def destinations(self, prefill_rank: int) -> tuple[int, ...]:
        """The decode ranks whose destination ``prefill_rank`` waits for before it leaves
        bootstrapping (their number is SGLang's ``required_dst_info_num``)."""
        self.prefill.check_rank(prefill_rank)
        tp, td = self.prefill.tp_size, self.decode.tp_size
        if tp >= td:
            return (prefill_rank // (tp // td),)
        k = td // tp
        return tuple(range(prefill_rank * k, (prefill_rank + 1) * k))

    def status_only(self, prefill_rank: int) -> bool:
        """``prefill_rank`` writes nothing; it only reports status to keep the TP poll agreeing."""
        return not self.sends(prefill_rank)

    def whole_pages(self, prefill_rank: int, decode_rank: int) -> bool:
        """The slices from ``prefill_rank`` to ``decode_rank`` are whole pages on both sides, so
        a plain page copy (one block per run per layer half) moves them."""
        per_src, per_dst = self.prefill.heads_per_rank, self.decode.heads_per_rank
        return per_src == per_dst and any(
            s.src_heads == range(per_src) and s.dst_heads == range(per_dst)
            for s in self.between(prefill_rank, decode_rank)
        )


def plan_slices(prefill: TPLayout, decode: TPLayout) -> SlicePlan:
    """The head slices from every prefill rank to every decode rank.

    Raises :class:`LayoutError` when the two sides hold different models' KV (head count, MLA)
    or their TP sizes do not divide one another.
    """
    if (prefill.kv_heads, prefill.mla) != (decode.kv_heads, decode.mla):
        raise LayoutError(
            f"prefill holds {prefill.kv_heads} KV heads (mla={prefill.mla}), decode holds "
            f"{decode.kv_heads} (mla={decode.mla}): the two sides serve different models"
        )
    tp, td = prefill.tp_size, decode.tp_size
    if tp % td and td % tp:
        raise LayoutError(
            f"prefill tp_size {tp} and decode tp_size {td}: one must divide the other "
            "(pdlife serve's --tp-size on either side)"
        )
    slices: list[HeadSlice] = []
    for d in range(td):
        pairs = []
        for h in decode.heads_of(d):
            senders, receivers = prefill.holders(h), decode.holders(h)
            i = receivers.index(d)
            pairs.append((h, senders[i * len(senders) // len(receivers)]))
        for p in sorted({src for _, src in pairs}):
            slices.extend(_slices(pairs, prefill, decode, p, d))
    return SlicePlan(prefill=prefill, decode=decode, slices=tuple(slices))
