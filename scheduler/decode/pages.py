"""The decode peer's KV resources: a request's pages and metadata slot, and a hybrid model's
state beside them.

Theory of operation
-------------------
A request holds nothing until ``preallocated``; from then until it ends it holds the pages of
its prompt (one more whenever its sequence crosses a page), a metadata slot, and with state
pools (:class:`~kv.state_pools.StatePools`, the prefill side's kinds) an SWA page for each of
its pages and one recurrent-state slot. :class:`PeerPages` is their one owner:

- :meth:`PeerPages.take` takes all of them at once, or nothing: pages (counted free only when
  the full and the SWA pool both have one), their SWA pages, a zeroed recurrent slot and a
  metadata slot. A request is taken only when every page it may come to hold (its prompt and
  ``max_new_tokens``) fits beside every page the requests already holding pages may still take
  (:meth:`PeerPages.reserved`): there is no retraction, so a decoding request must never wait
  for a page that only another waiting request could free.
- :meth:`PeerPages.send_destination` tells the receiver where the prefill side writes: the
  pages, the slot, and per state kind the items the last chunk fills, by the prefill side's own
  rule (:func:`kv.state_sends.chunk_send`: the SWA pages of the last window, the recurrent
  slot, every index page). A draft model's pages travel at the request's page indices.
- :meth:`PeerPages.grow` adds a page (and its SWA page) as the sequence grows;
  :meth:`PeerPages.item` is the forward item of a decode step, with its SWA pages and slot.
- :meth:`PeerPages.release` hands everything to the :class:`~kv.release.Releaser`, which frees
  it together, once, when the receiver is quiescent (the prefill side may still be writing any
  of it after an abort).

Like the prefill scheduler, the peer keeps an SWA page for every page until the request ends;
it does not give back the SWA pages that fell out of the window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, cast

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pages import pages_needed
from kv.pool import KVPool
from kv.release import Releaser, Transfer
from kv.state_pools import StateKind, StatePools
from kv.state_sends import chunk_send, state_tables
from kv.transfer import KVReceiver
from lifecycle import DecodeRequest
from scheduler.model.side_pools import check_runner_states
from scheduler.runner import ForwardItem, ModelRunner


class StateReceiver(Protocol):
    """A receiver that is told where each state kind lands (``kv.local_decode``)."""

    def send_metadata(
        self,
        pages: Sequence[int],
        slot: int,
        state: Mapping[StateKind, Sequence[int]] | None = None,
    ) -> None: ...


def check_state_manager(states: StatePools | None, runner: ModelRunner, kv: object) -> None:
    """ValueError unless ``states`` (when given) are built on the runner's pool, hold the SWA
    pool and recurrent states the runner computes in (its ``swa_pool`` and ``states``, for a
    runner that has them; a runner with either needs ``states``), and ``kv`` receives into
    them (a decode KV manager built with the same ``states=``), and unless ``kv`` receives
    into no state pools when none are given (the peer would hold no pages for them)."""
    if states is None:
        theirs = getattr(kv, "states", None)
        if theirs is not None:
            raise ValueError(
                f"states: the decode KV manager {type(kv).__name__} receives into state pools "
                "the peer was not given (build the DecodePeer with the same states=)")
    else:
        if states.full is not runner.pool:
            raise ValueError("states: the state pools must be built on the runner's KV pool")
        if getattr(kv, "states", None) is not states:
            raise ValueError(
                f"states: the decode KV manager {type(kv).__name__} does not receive "
                "into these state pools (build it with the same states=)"
            )
    check_runner_states(runner, states)


class PeerPages:
    """Pages, metadata slots and state of the decode peer's requests (module docstring)."""

    def __init__(
        self,
        pool: KVPool,
        slots: SlotAllocator,
        metadata: MetadataBuffers,
        states: StatePools | None = None,
    ) -> None:
        self.pool, self.slots, self.metadata, self.states = pool, slots, metadata, states
        self._state_slots: dict[str, int] = {}  # rid -> recurrent slot
        self._holders: dict[str, DecodeRequest] = {}  # the requests holding pages
        self._reserved = 0  # the pages they may still take (:meth:`reserved`)
        self._releaser = Releaser(pool, slots, metadata, states)

    def available(self) -> int:
        """Pages a request can take now: the fewer free of the full and the SWA pool."""
        if self.states is None:
            return self.pool.allocator.available()
        return self.states.pages_available()

    def final_pages(self, req: DecodeRequest) -> int:
        """The pages ``req`` holds if it decodes ``max_new_tokens``: its last token's K/V is
        never written, so positions ``0 .. prompt + max_new_tokens - 2``."""
        n = len(req.input_ids) + req.sampling.max_new_tokens - 1
        return pages_needed(max(n, len(req.input_ids)), self.pool.page_size)

    def to_come(self, req: DecodeRequest) -> int:
        """The pages ``req`` may still take."""
        return max(0, self.final_pages(req) - len(req.pages))

    def reserved(self) -> int:
        """The pages the requests holding pages may still take (kept as they take pages)."""
        return self._reserved

    def take(self, req: DecodeRequest) -> bool:
        """Give ``req`` the pages of its prompt with their state and a metadata slot when all
        the pages it may come to hold fit beside :meth:`reserved`; False, having taken
        nothing, otherwise."""
        need = pages_needed(len(req.input_ids), self.pool.page_size)
        states = self.states
        if self.available() - self.final_pages(req) < self._reserved or (
            states is not None and states.slots_available() == 0
        ):
            return False
        slot = self.slots.alloc()
        if slot is None:
            return False
        pages = self.pool.allocator.alloc(need)
        if pages is None:
            self.slots.free(slot)
            return False
        if states is not None:
            states.grow(pages)
            state_slot = states.take_slot()
            if state_slot is not None:
                self._state_slots[req.rid] = state_slot
        req.pages, req.slot = pages, slot
        self._holders[req.rid] = req
        self._reserved += self.to_come(req)
        self.metadata.clear(slot)
        return True

    def state_indices(self, req: DecodeRequest) -> dict[StateKind, tuple[int, ...]]:
        """Where each state kind of ``req``'s prompt lands: what the prefill side's last chunk
        sends, in this side's pools."""
        n = len(req.input_ids)
        tables = state_tables(self.states, req.pages, self._state_slots.get(req.rid), True)
        return dict(
            chunk_send(
                req.pages,
                length=n,
                sent=0,
                computed=n,
                last=True,
                page_size=self.pool.page_size,
                tables=tables,
            ).state
        )

    def send_destination(self, req: DecodeRequest, receiver: KVReceiver) -> None:
        """Hand ``receiver`` the request's pages, slot and (with state pools) state items."""
        assert req.slot is not None  # taken with the pages
        if self.states is None:
            receiver.send_metadata(req.pages, req.slot)
            return
        cast(StateReceiver, receiver).send_metadata(
            req.pages, req.slot, state=self.state_indices(req)
        )

    def grow(self, req: DecodeRequest, position: int) -> bool:
        """Hold the pages positions ``0 .. position`` need; False when none is free."""
        if pages_needed(position + 1, self.pool.page_size) <= len(req.pages):
            return True
        if self.available() < 1:
            return False
        after = req.pages[-1] if req.pages else None
        page = self.pool.allocator.alloc(1, after=after)
        if page is None:
            return False
        if self.states is not None:
            self.states.grow(page, after=after)
        self._reserved -= min(1, self.to_come(req))
        req.pages.extend(page)
        return True

    def state_slot(self, req: DecodeRequest) -> int:
        """``req``'s recurrent-state slot (-1 without one)."""
        return self._state_slots.get(req.rid, -1)

    def item(self, req: DecodeRequest, token: int, position: int) -> ForwardItem:
        """The decode step of ``req``: ``token`` at ``position``."""
        swa = None if self.states is None else self.states.swa
        return ForwardItem(
            req.rid,
            (token,),
            position,
            tuple(req.pages),
            swa_pages=() if swa is None else tuple(swa.translate(req.pages)),
            state_slot=self.state_slot(req),
        )

    def release(
        self,
        req: DecodeRequest,
        receiver: Transfer | None,
        on_clear: Callable[[], object] | None = None,
    ) -> None:
        """Hand ``req``'s pages, slots and state to the releaser (freed once ``receiver`` is
        quiescent, then ``on_clear`` is called) and clear them from the record."""
        if self._holders.pop(req.rid, None) is not None:
            self._reserved -= self.to_come(req)
        self._releaser.release(
            receiver, req.pages, req.slot, on_clear, state_slot=self._state_slots.pop(req.rid, None)
        )
        req.pages, req.slot = [], None

    def reap(self) -> bool:
        """Free what became quiescent; True if anything was freed."""
        return self._releaser.reap()

    def holding_back(self) -> bool:
        """Whether the releaser still holds anything back."""
        return bool(self._releaser)

    def check(self, live: Iterable[DecodeRequest]) -> None:
        """Invariant 3: the pages, SWA pages and recurrent slots of live requests and of the
        releaser, and the free ones, partition each pool (AssertionError or KVPoolError)."""
        live = list(live)
        held = [r.pages for r in live] + self._releaser.held_page_lists()
        self.pool.allocator.check_conservation(held)
        to_come = sum(self.to_come(r) for r in self._holders.values())
        if to_come != self._reserved:
            raise AssertionError(
                f"reserved pages: kept {self._reserved}, the holders may still take {to_come}"
            )
        if self.states is None:
            return
        for req in live:
            want = self.states.recurrent is not None and bool(req.pages)
            if (req.rid in self._state_slots) != want:
                raise AssertionError(
                    f"{req.rid} holds {len(req.pages)} pages and recurrent "
                    f"slot {self._state_slots.get(req.rid)}"
                )
        slots = len(self._state_slots) + self._releaser.held_state_slots
        self.states.check_conservation(held, slots)
