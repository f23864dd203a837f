"""Rank collectives the scheduler needs: the row all-gather and the MIN-reduction.

Theory of operation
-------------------
Some scheduler decisions must be taken identically by every rank on the same pass (the
PrefillDelayer's allow/delay gate; transitions driven by transfer polls). Each rank contributes a
small row of integers, a collective combines them, and every rank then runs the same pure function
on the same combined value. Nothing here decides anything; it only moves integers.

``RowGather.gather(row)`` returns the **table**: a nested list indexed ``table[dp][tp]`` holding
the row each rank contributed, ``dp`` in ``range(dp_size)`` and ``tp`` in
``range(attn_tp_size)``. Nested Python lists (not a tensor) keep the deciding code free of torch
and make a table easy to write by hand in a test. Every rank must call ``gather`` the same number
of times, in the same order, with rows of the same width: it is a collective.

``TorchDistributedGather`` runs ``all_gather_into_tensor`` (``all_gather_single``) over an int64
tensor: on a gloo group with ``device="cpu"``, or on an NCCL device group with a CUDA device. Use
gloo when overlap scheduling is on: an NCCL collective would queue behind the forward running on
the device and stall the scheduler's CPU work that overlap exists to hide. With overlap off the
scheduler waits for the device anyway, and the NCCL gather is the faster one. The group must hold
exactly ``dp_size * attn_tp_size`` ranks ordered DP-major (the order in which the scheduler builds
its groups), so the flat gather result reshapes to ``[dp][tp]``.

``min_reduce`` combines per-request poll results (``KVPoll``-ordered ints, where the MIN is the
most pessimistic state) across the ranks of a TP group over gloo. ``all_gather_rows`` gathers
rows of any length, one per rank (the keys to agree on, a pipeline stage's view of its requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

# ``all_gather_into_tensor`` was renamed ``all_gather_single`` (same semantics); the old name
# warns on new torch releases and the new one is missing on old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Row = list[int]
Table = list[list[Row]]
"""``table[dp][tp]``: the row contributed by attention-TP rank ``tp`` of DP replica ``dp``."""


class GatherShapeError(ValueError):
    """A gather was configured with, or produced, a shape that does not match the ranks."""


class RowGather(Protocol):
    """All-gathers one row of ints per rank into a ``[dp_size][attn_tp_size]`` table of rows."""

    def gather(self, row: Sequence[int]) -> Table: ...

    def peers_busy(self) -> bool:
        """Whether the last gather said another rank still has work that needs this rank to
        keep stepping (only a gather whose ranks step in lockstep knows; the others say no)."""
        ...


class StaticGather:
    """A gather with no process group: for a single rank, or for tests that set the table.

    With no ``table`` it is the single-rank gather: the table is ``[[row]]``. With a ``table`` it
    returns a copy of that table, with this rank's own row written at ``position`` (``(dp, tp)``)
    when one is given, so a test supplies the other ranks' rows and the component under test
    supplies its own. Every row passed in is kept in ``sent``, in order.
    """

    def __init__(
        self, table: Sequence[Sequence[Sequence[int]]] | None = None,
        position: tuple[int, int] | None = None,
    ) -> None:
        self.sent: list[tuple[int, ...]] = []
        self._table: Table | None = None
        self._position = position
        if table is not None:
            self.set_table(table)
        elif position is not None:
            raise GatherShapeError("StaticGather: position needs a table to place the row in")

    def set_table(self, table: Sequence[Sequence[Sequence[int]]]) -> None:
        """Replace the table returned by later gathers."""
        copied = [[[int(v) for v in row] for row in replica] for replica in table]
        if not copied or any(not replica for replica in copied):
            raise GatherShapeError("StaticGather: the table needs >= 1 DP entry of >= 1 row each")
        if self._position is not None:
            dp, tp = self._position
            if not (0 <= dp < len(copied) and 0 <= tp < len(copied[dp])):
                raise GatherShapeError(
                    f"StaticGather: position {self._position} is outside the table "
                    f"({len(copied)} DP entries)"
                )
        self._table = copied

    def peers_busy(self) -> bool:
        return False

    def gather(self, row: Sequence[int]) -> Table:
        own = [int(v) for v in row]
        self.sent.append(tuple(own))
        if self._table is None:
            return [[own]]
        table = [[list(r) for r in replica] for replica in self._table]
        if self._position is not None:
            dp, tp = self._position
            table[dp][tp] = own
        return table


class TorchDistributedGather:
    """``RowGather`` over a ``torch.distributed`` group (gloo on CPU, NCCL on a CUDA device).

    ``dp_size`` is the number of DP replicas in ``group`` (1 when attention is not data-parallel,
    as then the whole group is one replica) and ``attn_tp_size`` the ranks per replica.
    """

    def __init__(
        self, group: Any, dp_size: int, attn_tp_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if dp_size < 1 or attn_tp_size < 1:
            raise GatherShapeError(
                f"dp_size and attn_tp_size must be >= 1, got {dp_size} and {attn_tp_size}"
            )
        world = dist.get_world_size(group)
        if world != dp_size * attn_tp_size:
            raise GatherShapeError(
                f"the gather group has {world} ranks but dp_size * attn_tp_size = "
                f"{dp_size} * {attn_tp_size} = {dp_size * attn_tp_size}; pass the group of "
                "exactly the ranks that negotiate together"
            )
        self._group = group
        self._dp_size = dp_size
        self._attn_tp_size = attn_tp_size
        self._device = torch.device(device)
        # One receive buffer per row width, allocated once: the gather runs every pass.
        self._buffers: dict[int, torch.Tensor] = {}

    def peers_busy(self) -> bool:
        return False

    def gather(self, row: Sequence[int]) -> Table:
        width = len(row)
        buffer = self._buffers.get(width)
        if buffer is None:
            buffer = torch.empty(
                (self._dp_size, self._attn_tp_size, width), dtype=torch.int64, device=self._device
            )
            self._buffers[width] = buffer
        local = torch.tensor([int(v) for v in row], dtype=torch.int64, device=self._device)
        _all_gather_single(buffer.view(-1), local, group=self._group)
        table: Table = buffer.tolist()
        return table


def min_reduce(values: Sequence[int], group: Any) -> list[int]:
    """Element-wise MIN of ``values`` across the ranks of ``group`` (a gloo group).

    All ranks must pass lists of the same length. An empty list returns ``[]`` without a
    collective; since the lengths agree, every rank skips it together.
    """
    if not values:
        return []
    tensor = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    reduced: list[int] = tensor.tolist()
    return reduced


def all_gather_rows(values: Sequence[int], group: Any) -> list[list[int]]:
    """Every rank's ``values`` (each rank's list may have its own length), in rank order of
    ``group`` (a gloo group; None is the default group).

    Two collectives: the lengths, then the rows padded to the longest. Every rank must call it
    the same number of times, in the same order.
    """
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(values)], dtype=torch.int64), group=group)
    lengths = [int(s.item()) for s in sizes]
    width = max(lengths)
    if width == 0:
        return [[] for _ in range(world)]
    padded = torch.zeros(width, dtype=torch.int64)
    padded[: len(values)] = torch.tensor([int(v) for v in values], dtype=torch.int64)
    gathered = [torch.empty(width, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[:n].tolist() for g, n in zip(gathered, lengths, strict=True)]
