"""What each chunk sends from each pool (kv.state_sends): by hand, then as properties over
random prompts, chunk cuts, windows and page tables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv.pages import pages_needed
from kv.state_pools import StateKind
from kv.state_sends import ChunkSend, StateTables, chunk_send, window_span
from tests.strategies import chunked_prompts

PAGES = [40, 41, 42, 7, 8]  # a page table: full-pool pages of positions 0, 1, 2, ...
SWA = [3, 4, 5, 0, 1]  # the SWA page of each of them


def _run(progress: list[int], length: int, page_size: int, pages: list[int],
         tables: StateTables) -> list[ChunkSend]:
    """The sends of a request computed in chunks up to each of ``progress``, as the scheduler
    makes them (a send that does not go leaves ``sent`` as it was)."""
    return [send for _, send in _run_at(progress, length, page_size, pages, tables)]


def _run_at(progress: list[int], length: int, page_size: int, pages: list[int],
            tables: StateTables) -> list[tuple[int, ChunkSend]]:
    """:func:`_run`'s sends, each with the tokens computed when it went."""
    sent, out = 0, []
    for computed in progress:
        send = chunk_send(pages[: pages_needed(computed, page_size)], length=length, sent=sent,
                          computed=computed, last=computed == length, page_size=page_size,
                          tables=tables)
        if send.goes:
            out.append((computed, send))
            sent = send.sent
    return out


def test_window_span_aligns_the_start_down_to_a_page() -> None:
    assert window_span(10, 5, 4) == range(1, 3)  # tokens [4, 10): pages 1, 2
    assert window_span(10, 6, 4) == range(1, 3)  # [4, 10) again
    assert window_span(10, 7, 4) == range(0, 3)  # [3 -> 0, 10)
    assert window_span(8, 4, 4) == range(1, 2)  # exactly the last page
    assert window_span(3, 100, 4) == range(0, 1)  # the window is longer than the prompt
    assert window_span(0, 4, 4) == range(0, 0)
    with pytest.raises(ValueError, match="window must be > 0"):
        window_span(8, 0, 4)


def test_window_spanning_a_chunk_boundary_sends_earlier_chunks_swa_pages_last() -> None:
    # 18 tokens, pages of 4, window 9: tokens [9, 18) -> page_floor 8 -> pages 2, 3, 4. The
    # first chunk (12 tokens) ends inside the window: its full pages go at once, but page 2's
    # SWA page waits for the last chunk, with the rest of the window.
    tables = StateTables(window=9, swa_pages=SWA, slot=6, index=True, draft=True)
    first, last = _run([12, 18], 18, 4, PAGES, tables)
    assert first.pages == first.draft_pages == (40, 41, 42) and not first.state
    assert (first.last, first.sent) == (False, 12)
    assert last.pages == last.draft_pages == (7, 8) and last.last and last.sent == 18
    assert last.state == {
        StateKind.SWA: (5, 0, 1),
        StateKind.RECURRENT: (6,),
        StateKind.INDEX: (40, 41, 42, 7, 8),
    }


def test_a_partial_page_waits_for_the_next_chunk() -> None:
    sends = _run([6, 7, 13], 13, 4, PAGES, StateTables())
    # 6 tokens: page 0 is full, page 1 is not; 7 tokens: still nothing new full.
    assert [(s.pages, s.sent) for s in sends] == [((40,), 4), ((41, 42, 7), 13)]
    assert [s.draft_pages for s in sends] == [(), ()]  # no draft pool
    assert sends[-1].state == {}


def test_a_non_last_chunk_with_no_full_page_sends_nothing() -> None:
    send = chunk_send(PAGES[:1], length=9, sent=0, computed=3, last=False, page_size=4)
    assert not send.goes and send.pages == () and send.sent == 0


def test_a_last_chunk_with_nothing_left_still_goes_with_the_state() -> None:
    send = chunk_send(PAGES[:2], length=8, sent=8, computed=8, last=True, page_size=4,
                      tables=StateTables(slot=2))
    assert send.goes and send.pages == () and send.state == {StateKind.RECURRENT: (2,)}


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="page-aligned"):
        chunk_send(PAGES, length=9, sent=3, computed=5, last=False, page_size=4)
    with pytest.raises(ValueError, match="must compute all 9"):
        chunk_send(PAGES, length=9, sent=0, computed=8, last=True, page_size=4)
    with pytest.raises(ValueError, match="cannot hold"):
        chunk_send(PAGES[:1], length=9, sent=0, computed=8, last=False, page_size=4)


@given(chunked_prompts(), st.integers(min_value=1, max_value=150), st.booleans(),
       st.randoms(use_true_random=False))
def test_every_page_goes_once_and_the_state_covers_the_last_window(
    case: tuple[int, int, list[int]], window: int, draft: bool, rng: object,
) -> None:
    page_size, length, progress = case
    n = pages_needed(length, page_size)
    pages = rng.sample(range(4 * n), n)  # type: ignore[attr-defined]
    swa = rng.sample(range(2 * n), n)  # type: ignore[attr-defined]
    tables = StateTables(window=window, swa_pages=swa, slot=length % 5, index=True, draft=draft)
    timed = _run_at(progress, length, page_size, pages, tables)
    sends = [send for _, send in timed]
    # Every page of the request goes exactly once, in order; the draft's copies with them.
    assert [p for s in sends for p in s.pages] == pages
    assert all(s.draft_pages == (s.pages if draft else ()) for s in sends)
    # Only the last send is last, and only it carries state.
    assert [s.last for s in sends] == [False] * (len(sends) - 1) + [True]
    assert all(not s.state for s in sends[:-1])
    # A non-last send holds only pages its chunk filled completely, and every one of them.
    for computed, s in timed[:-1]:
        assert s.sent == computed // page_size * page_size
    state = sends[-1].state
    first = max(0, length - window) // page_size
    assert state[StateKind.SWA] == tuple(swa[first:])
    # The SWA pages cover the window: from a page boundary at or before its first token.
    assert first * page_size <= max(0, length - window) < first * page_size + page_size
    assert state[StateKind.RECURRENT] == (length % 5,)
    assert state[StateKind.INDEX] == tuple(pages)
