"""How the ranks of a tensor-parallel group agree before any transition fires.

Every rank polls the same rooms in the same order and combines the results by MIN (the KVPoll
order makes the most pessimistic state win), so all ranks take the same transitions on the same
pass (invariant 6). Readiness is pushed per rank, so the rooms to poll are first agreed: the
union of every rank's changed requests, named by their admission number (the same on every rank,
since every rank admits the same requests in the same order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist

from scheduler.dist.gather import all_gather_rows, min_reduce


class RankSync(Protocol):
    def agree_keys(self, keys: Sequence[int]) -> list[int]: ...

    def min_reduce(self, values: Sequence[int]) -> list[int]: ...


class SingleRank:
    """A TP group of one: nothing to agree on."""

    def agree_keys(self, keys: Sequence[int]) -> list[int]:
        return list(keys)

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        return list(values)


class TorchRanks:
    """A TP group over ``torch.distributed`` (gloo on CPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)

    def agree_keys(self, keys: Sequence[int]) -> list[int]:
        return sorted({k for row in all_gather_rows(keys, self.group) for k in row})

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        return min_reduce(values, self.group)
