"""Hypothesis strategies shared by the test modules, one section per area.

Generic lifecycle strategies (walks and event sequences over any table) are public API in
:mod:`lifecycle.testing`; this module re-exports them next to the project's own record builders.
"""

from __future__ import annotations

from hypothesis import strategies as st

from lifecycle import DecodeRequest, PrefillRequest, SamplingParams
from lifecycle.testing import event_sequences, failure_reasons, legal_walks

# -- lifecycle ----------------------------------------------------------------------------------

__all__ = [
    "decode_request",
    "event_sequences",
    "failure_reasons",
    "legal_walks",
    "prefill_request",
    "prompts",
    "rids",
    "sampling_params",
]

rids = st.from_regex(r"[a-z][a-z0-9-]{0,11}", fullmatch=True)

#: Prompts of at least two tokens, so a prefill request can be split into chunks.
prompts = st.lists(st.integers(min_value=0, max_value=255), min_size=2, max_size=64)

sampling_params = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(min_value=1, max_value=64),
    stop_token_ids=st.lists(st.integers(min_value=0, max_value=255), max_size=3),
    ignore_eos=st.booleans(),
)


def prefill_request(rid: str, prompt_len: int = 8) -> PrefillRequest:
    """A fresh, unadmitted prefill request with a prompt of ``prompt_len`` tokens."""
    return PrefillRequest(rid, input_ids=list(range(prompt_len)), bootstrap_room=len(rid))


def decode_request(rid: str) -> DecodeRequest:
    """A fresh, unadmitted decode request."""
    return DecodeRequest(rid, input_ids=[1, 2, 3])


# -- KV layer --------------------------------------------------------------------------------


@st.composite
def page_pairs(draw: st.DrawFn, max_pages: int = 200) -> tuple[list[int], list[int]]:
    """Equal-length source and destination page lists, each built from
    consecutive runs of random lengths so that coalescing has runs to find."""
    n = draw(st.integers(min_value=0, max_value=max_pages))

    def side() -> list[int]:
        pages: list[int] = []
        while len(pages) < n:
            start = draw(st.integers(min_value=0, max_value=4 * max_pages))
            run = draw(st.integers(min_value=1, max_value=n - len(pages)))
            pages.extend(range(start, start + run))
        return pages

    return side(), side()


def alloc_free_ops(max_ops: int = 60) -> st.SearchStrategy[list[tuple[str, int]]]:
    """Allocator operations: ``("alloc", n)`` takes n pages, ``("free", i)`` frees the
    i-th live allocation (modulo how many are live)."""
    op = st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=0, max_value=12)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=1000)),
    )
    return st.lists(op, max_size=max_ops)
