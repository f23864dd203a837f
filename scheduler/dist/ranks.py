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

import torch
import torch.distributed as dist

from scheduler.dist.gather import min_reduce


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
        local = torch.tensor(list(keys), dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(local)], dtype=torch.int64), group=self.group)
        width = max(int(s.item()) for s in sizes)
        if width == 0:
            return []
        padded = torch.full((width,), -1, dtype=torch.int64)
        padded[: len(local)] = local
        gathered = [torch.empty(width, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.group)
        union = {int(x) for g in gathered for x in g.tolist() if x >= 0}
        return sorted(union)

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        return min_reduce(values, self.group)
