"""Returning a request's KV resources: at once, or once its transfer can no longer touch them.

A request that ends while a transfer engine may still read its pages (prefill: an abort or a
failure mid-transfer) or write them (decode: the same, from the other side) must not hand its
pages or metadata slot back yet: the next owner's data would be overwritten, or sent. The
lifecycle's ``release`` hook gives them to :class:`Releaser`, which frees them now if the
sender (receiver) is quiescent, and otherwise keeps them until :meth:`Releaser.reap` finds it
quiescent. ``clear()`` — forgetting the room — comes after that, so a late message for the room
is still recognised as such. The prefill and the decode scheduler each keep one releaser.

With the prefix cache on, a request's page table mixes the tree's pages (locked through its
:class:`~kv.radix.PrefixHold`) and its own; the releaser frees its own pages and unlocks the
hold at the same moment, so no tree page it used can be evicted while the transfer reads it.

A hybrid model's state (:mod:`kv.state_pools`) goes with the pages: the SWA pages of the freed
pages and the request's recurrent-state slot are freed at the same moment, never before the
transfer that may read them is quiescent.

On a mesh (``agree``), each rank's sender goes quiescent when its own writes end, but every
rank must free a request's pages and slot on the same pass, or the ranks' free pages and slots,
and so their batches, would differ. There every finished request is held, and :meth:`reap`
frees those the ranks agree on: the MIN of every rank's quiescence, over the held requests in
release order (the same on every rank, since requests end on the same pass everywhere). Then
:meth:`Releaser.reap` is a collective whenever something is held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from kv.radix import PrefixHold
from kv.state_pools import StatePools


class Transfer(Protocol):
    """The part of a sender or receiver the releaser needs."""

    def quiescent(self) -> bool: ...

    def clear(self) -> None: ...


@attrs.frozen
class _Held:
    """One finished request's resources, waiting for its transfer to go quiescent."""

    transfer: Transfer | None
    pages: list[int]
    slot: int | None
    on_clear: Callable[[], object] | None
    hold: PrefixHold | None
    state_slot: int | None = None


class Releaser:
    """Frees pages and slots exactly once, never while a transfer may still use them."""

    def __init__(self, pool: KVPool, slots: SlotAllocator, metadata: MetadataBuffers,
                 states: StatePools | None = None,
                 agree: Callable[[Sequence[int]], list[int]] | None = None) -> None:
        """``agree``: on a mesh, the MIN of each value over the ranks (see the module)."""
        self.pool = pool
        self.states = states
        self.slots = slots
        self.metadata = metadata
        self._agree = agree
        self._held: list[_Held] = []

    def release(
        self,
        transfer: Transfer | None,
        pages: Sequence[int],
        slot: int | None,
        on_clear: Callable[[], object] | None = None,
        hold: PrefixHold | None = None,
        state_slot: int | None = None,
    ) -> None:
        """Free ``pages`` (with their SWA pages), ``slot`` and the recurrent ``state_slot``
        and release the prefix-cache ``hold`` once ``transfer`` is quiescent; then ``clear()``
        it and call ``on_clear`` (the owner forgets the room only then, so it is not reused
        early)."""
        held = _Held(transfer, list(pages), slot, on_clear, hold, state_slot)
        if transfer is not None and (self._agree is not None or not transfer.quiescent()):
            self._held.append(held)
            return
        self._finish(held)

    def reap(self) -> bool:
        """Free what became quiescent (on a mesh: on every rank); True if anything was
        freed."""
        if not self._held:
            return False
        quiet = [held.transfer is None or held.transfer.quiescent() for held in self._held]
        if self._agree is not None:
            quiet = [bool(q) for q in self._agree([int(q) for q in quiet])]
        keep = []
        for held, done in zip(self._held, quiet, strict=True):
            if done:
                self._finish(held)
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
        return [held.pages for held in self._held]

    def held_prefix_holds(self) -> list[PrefixHold]:
        """The prefix-cache holds kept until their transfer is quiescent (for lock checks)."""
        return [held.hold for held in self._held if held.hold is not None]

    @property
    def held_slots(self) -> int:
        return sum(1 for held in self._held if held.slot is not None)

    @property
    def held_state_slots(self) -> int:
        """Recurrent-state slots held back (for conservation checks)."""
        return sum(1 for held in self._held if held.state_slot is not None)

    def _finish(self, held: _Held) -> None:
        if held.transfer is not None:
            held.transfer.clear()
        if held.on_clear is not None:
            held.on_clear()
        if self.states is not None:
            self.states.release(held.pages, held.state_slot)
        if held.pages:
            self.pool.allocator.free(held.pages)
        if held.hold is not None:
            held.hold.release()
        if held.slot is not None:
            self.metadata.clear(held.slot)
            self.slots.free(held.slot)
