"""Freeing on a mesh (:class:`kv.release.Releaser` with ``agree``): a finished request's pages
and slot go back on the pass every rank's transfer is quiescent, never when only this rank's
is, so the ranks' free pages and slots stay equal."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.release import Releaser
from scheduler.dist.gather import min_reduce
from tests.distributed import free_port, gloo_group, run_ranks
from tests.transfer_harness import make_pool


@attrs.define
class Transfer:
    quiet: bool = False
    cleared: bool = False

    def quiescent(self) -> bool:
        return self.quiet

    def clear(self) -> None:
        self.cleared = True


@attrs.define
class OtherRank:
    """The MIN with another rank's quiescence of the same held requests (in release order)."""

    quiet: list[int] = attrs.Factory(list)
    calls: int = 0

    def agree(self, values: Sequence[int]) -> list[int]:
        self.calls += 1
        assert len(values) == len(self.quiet)  # the ranks hold the same requests
        return [min(a, b) for a, b in zip(values, self.quiet, strict=True)]


def test_pages_and_slots_go_back_only_once_every_rank_is_quiescent() -> None:
    pool, slots = make_pool(), SlotAllocator(4)
    other = OtherRank()
    releaser = Releaser(pool, slots, MetadataBuffers(4), agree=other.agree)
    assert not releaser.reap() and other.calls == 0  # nothing held: no collective
    first, second = Transfer(quiet=True), Transfer()
    pages = [pool.allocator.alloc(2), pool.allocator.alloc(1)]
    held = [slots.alloc(), slots.alloc()]
    releaser.release(first, pages[0], held[0])  # quiescent here, but held for the others
    releaser.release(second, pages[1], held[1])
    assert len(releaser) == 2 and pool.allocator.in_use() == 3
    other.quiet = [0, 1]  # the other rank still writes the first, is done with the second
    assert not releaser.reap()
    assert len(releaser) == 2 and slots.available() == 2
    other.quiet = [1, 1]
    second.quiet = True
    assert releaser.reap()
    assert first.cleared and second.cleared
    assert len(releaser) == 0 and pool.allocator.in_use() == 0 and slots.available() == 4
    assert not releaser.reap() and other.calls == 2


def test_one_rank_frees_a_quiescent_transfer_at_once() -> None:
    pool, slots = make_pool(), SlotAllocator(2)
    releaser = Releaser(pool, slots, MetadataBuffers(2))
    transfer = Transfer(quiet=True)
    releaser.release(transfer, pool.allocator.alloc(2), slots.alloc())
    assert transfer.cleared and len(releaser) == 0 and pool.allocator.in_use() == 0


# Pass (from 0) on which each of two gloo ranks finds each of three held transfers quiescent.
QUIET_FROM = {0: [0, 2, 1], 1: [1, 0, 3]}


def _rank(rank: int, port: int, out: str) -> None:
    with gloo_group(rank, 2, port):
        pool, slots = make_pool(), SlotAllocator(3)
        releaser = Releaser(
            pool, slots, MetadataBuffers(3), agree=functools.partial(min_reduce, group=None)
        )
        transfers = [Transfer() for _ in QUIET_FROM[rank]]
        for transfer in transfers:
            releaser.release(transfer, pool.allocator.alloc(1), slots.alloc())
        freed = []
        for step in range(5):
            for transfer, quiet_from in zip(transfers, QUIET_FROM[rank], strict=True):
                transfer.quiet = step >= quiet_from
            releaser.reap()
            freed.append(slots.available())
        Path(out, f"{rank}.json").write_text(json.dumps(freed))


@pytest.mark.multiprocess
def test_two_gloo_ranks_free_on_the_same_pass(tmp_path: Path) -> None:
    run_ranks(_rank, (free_port(), str(tmp_path)), 2, 120.0)
    freed = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    # Each transfer goes back once both ranks are quiescent: passes 1, 2 and 3.
    assert freed[0] == freed[1] == [0, 1, 2, 3, 3]
