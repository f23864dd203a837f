"""What one chunk of a request sends from each pool: a pure function of the request's page
tables and progress.

Theory of operation
-------------------
A request's prompt is computed in chunks; after each, its sender is handed what the decode
side can already use (:mod:`kv.transfer`, step 4 of the sender protocol):

- a **non-last** chunk sends the full-attention pages its tokens filled completely, from the
  first page not sent yet; a partial last page waits for the next chunk (it is still being
  written). With a draft pool the same page indices go from the draft pool too: the draft
  shares the target's pages.
- the **last** chunk sends every page not sent yet, partial or not (and the draft's copies),
  and the request's ``state_indices`` by kind (:class:`~kv.state_pools.StateKind`):

  ============  ===========================================================================
  ``swa``       the SWA-pool pages of tokens ``[page_floor(len - W), len)``: the last window
                ``W``, its start aligned down to a page, translated from the full pool's
                page indices into the SWA pool's
  ``recurrent`` the request's one recurrent-state slot
  ``index``     every page of the request (the index pool shares the full pool's indices)
  ============  ===========================================================================

  State is sent once, on the last chunk only: the window's pages, the recurrent state and the
  index keys are final only when the whole prompt was computed. The window may start in any
  earlier chunk; those chunks already sent the *full* pages of those tokens, but never their
  SWA pages.

:func:`chunk_send` is the whole rule; the scheduler calls it per chunk and hands its answer to
the sender. It knows nothing of allocators: the SWA page table (the SWA page of each full page)
is an input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from kv.pages import pages_needed
from kv.state_pools import StateKind, StatePools


def window_span(length: int, window: int, page_size: int) -> range:
    """The positions, in a request's page table, of the pages that hold tokens
    ``[page_floor(length - window), length)``: the last ``window`` tokens, start aligned down to
    a page (empty for an empty request)."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    first = max(0, length - window) // page_size
    return range(first, pages_needed(length, page_size))


@attrs.frozen
class StateTables:
    """A request's state beside its full pages, as :func:`chunk_send` reads it: ``window`` and
    ``swa_pages`` (the SWA page of each full page) with an SWA pool, ``slot`` with a recurrent
    pool, ``index`` with an index pool, ``draft`` with a draft pool."""

    window: int | None = None
    swa_pages: Sequence[int] = ()
    slot: int | None = None
    index: bool = False
    draft: bool = False


NO_STATE = StateTables()


@attrs.frozen
class ChunkSend:
    """What one chunk sends: ``pages`` from the full pool, ``draft_pages`` (the same indices)
    from the draft pool, ``state`` (last chunk only) by kind; ``sent`` is the tokens handed to
    the sender once this chunk went."""

    pages: tuple[int, ...]
    draft_pages: tuple[int, ...]
    state: Mapping[StateKind, tuple[int, ...]]
    last: bool
    sent: int

    @property
    def goes(self) -> bool:
        """Whether the sender is called: a last chunk always is (it concludes the transfer and
        carries the metadata row), another only with pages."""
        return self.last or bool(self.pages)


def chunk_send(
    pages: Sequence[int],
    *,
    length: int,
    sent: int,
    computed: int,
    last: bool,
    page_size: int,
    tables: StateTables = NO_STATE,
) -> ChunkSend:
    """What the chunk that brought the request to ``computed`` tokens sends, ``sent`` tokens
    (a multiple of ``page_size``) having gone before; ``pages`` is the request's page table,
    ``length`` its prompt's tokens. See the module docstring."""
    if sent % page_size or not 0 <= sent <= computed <= length:
        raise ValueError(f"need sent ({sent}) page-aligned and sent <= computed ({computed}) "
                         f"<= length ({length})")
    if last and computed != length:
        raise ValueError(f"the last chunk must compute all {length} tokens, not {computed}")
    if len(pages) < pages_needed(computed, page_size):
        raise ValueError(f"{len(pages)} pages cannot hold {computed} tokens")
    upto = computed if last else computed // page_size * page_size
    end = pages_needed(upto, page_size)
    chosen = tuple(pages[sent // page_size : end]) if upto > sent else ()
    state: dict[StateKind, tuple[int, ...]] = {}
    if last:
        if tables.window is not None:
            span = window_span(length, tables.window, page_size)
            state[StateKind.SWA] = tuple(tables.swa_pages[i] for i in span)
        if tables.slot is not None:
            state[StateKind.RECURRENT] = (tables.slot,)
        if tables.index:
            state[StateKind.INDEX] = tuple(pages[:end])
    return ChunkSend(chosen, chosen if tables.draft else (), state, last, upto)


@runtime_checkable
class StateSender(Protocol):
    """A sender that moves state: :meth:`send_state` is called once, just before the last
    chunk's ``send``, with that chunk's ``state_indices``; the backend moves them with the last
    chunk and concludes SUCCESS only once they landed. A sender without it moves no state (the
    fake backend, which moves nothing at all)."""

    def send_state(self, state: Mapping[StateKind, Sequence[int]]) -> None: ...


def state_tables(states: StatePools | None, pages: Sequence[int], slot: int | None,
                 last: bool) -> StateTables:
    """What :func:`chunk_send` reads of a request holding ``pages`` and recurrent ``slot`` in
    ``states`` (the SWA translation is looked up for the last chunk only)."""
    if states is None:
        return NO_STATE
    return StateTables(
        window=states.window,
        swa_pages=states.swa.translate(pages) if last and states.swa is not None else (),
        slot=slot, index=states.index is not None, draft=states.draft is not None,
    )
