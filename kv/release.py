"""Returning a request's KV resources: at once, or once its transfer can no longer touch them.

A request that ends while a transfer engine may still read its pages (prefill: an abort or a
failure mid-transfer) or write them (decode: the same, from the other side) must not hand its
pages or metadata slot back yet: the next owner's data would be overwritten, or sent. The
lifecycle's ``release`` hook gives them to :class:`Releaser`, which frees them now if the
sender (receiver) is quiescent, and otherwise keeps them until :meth:`Releaser.reap` finds it
quiescent. ``clear()`` — forgetting the room — comes after that, so a late message for the room
is still recognised as such. The prefill and the decode scheduler each keep one releaser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool


class Transfer(Protocol):
    """The part of a sender or receiver the releaser needs."""

    def quiescent(self) -> bool: ...

    def clear(self) -> None: ...


class Releaser:
    """Frees pages and slots exactly once, never while a transfer may still use them."""

    def __init__(self, pool: KVPool, slots: SlotAllocator, metadata: MetadataBuffers) -> None:
        self.pool = pool
        self.slots = slots
        self.metadata = metadata
        self._held: list[tuple[Transfer, list[int], int | None, Callable[[], object] | None]] = []

    def release(
        self,
        transfer: Transfer | None,
        pages: Sequence[int],
        slot: int | None,
        on_clear: Callable[[], object] | None = None,
    ) -> None:
        """Free ``pages`` and ``slot`` once ``transfer`` is quiescent; then ``clear()`` it and
        call ``on_clear`` (the owner forgets the room only then, so it is not reused early)."""
        if transfer is not None and not transfer.quiescent():
            self._held.append((transfer, list(pages), slot, on_clear))
            return
        self._finish(transfer, pages, slot, on_clear)

    def reap(self) -> bool:
        """Free what became quiescent; True if anything was freed."""
        if not self._held:
            return False
        keep = []
        for held in self._held:
            if held[0].quiescent():
                self._finish(*held)
            else:
                keep.append(held)
        freed = len(keep) != len(self._held)
        self._held = keep
        return freed

    def __len__(self) -> int:
        """Requests whose resources are held back."""
        return len(self._held)

    def held_page_lists(self) -> list[list[int]]:
        """The pages held back, one list per request (for conservation checks)."""
        return [held[1] for held in self._held]

    @property
    def held_slots(self) -> int:
        return sum(1 for held in self._held if held[2] is not None)

    def _finish(
        self,
        transfer: Transfer | None,
        pages: Sequence[int],
        slot: int | None,
        on_clear: Callable[[], object] | None,
    ) -> None:
        if transfer is not None:
            transfer.clear()
        if on_clear is not None:
            on_clear()
        if pages:
            self.pool.allocator.free(list(pages))
        if slot is not None:
            self.metadata.clear(slot)
            self.slots.free(slot)
