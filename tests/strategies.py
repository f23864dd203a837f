"""Hypothesis strategies shared by the test modules, one section per area.

Generic lifecycle strategies (walks and event sequences over any table) are public API in
:mod:`lifecycle.testing`; this module re-exports them next to the project's own record builders.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kv.layouts import TPLayout
from lifecycle import DecodeRequest, PrefillRequest, SamplingParams
from lifecycle.testing import event_sequences, failure_reasons, legal_walks
from scheduler.prefill.delayer import DelayerConfig

# -- lifecycle ----------------------------------------------------------------------------------

__all__ = [
    "decode_request",
    "event_sequences",
    "failure_reasons",
    "layout_pairs",
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


#: TP sizes SGLang deployments use, powers of two and not.
_TP_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[TPLayout, TPLayout]:
    """A prefill and a decode TP layout of one model that a slice plan can join: TP sizes that
    divide one another, a head count that splits or replicates evenly on both sides (any head
    count for MLA)."""
    mla = draw(st.booleans())
    tp = draw(st.sampled_from(_TP_SIZES))
    td = draw(st.sampled_from([t for t in _TP_SIZES if t % tp == 0 or tp % t == 0]))
    if mla:
        heads = draw(st.integers(min_value=1, max_value=4))
    else:
        heads = draw(st.sampled_from([
            h for h in range(1, 49) if all(h % t == 0 or t % h == 0 for t in (tp, td))
        ]))
    return TPLayout(tp, heads, mla), TPLayout(td, heads, mla)


# -- PrefillDelayer ------------------------------------------------------------------------------
# Imports stay with their section (sections are appended independently).


#: One rank's inputs to a negotiation:
#: ``(prefillable, token_usage, running_batch, max_prefill_bs, waiting_queue_len)``.
DelayerInput = tuple[bool, float, int, int, int]
#: Passes (every rank's inputs, ``max_running_requests``) and the clock step before each pass.
DelayerScenario = tuple[list[tuple[list[DelayerInput], int]], list[float]]


def delayer_configs(
    mode: str | None = None, watermark: bool = True, queue: bool | None = None,
) -> st.SearchStrategy[DelayerConfig]:
    """Small delayer configs. ``mode`` pins the mode; ``watermark=False`` turns the watermark
    off; ``queue`` True always sets the queue trigger (with ratios large enough that it usually
    fires), False never does, None either."""
    ratios = st.floats(0.05, 1.0)
    return st.builds(
        DelayerConfig,
        max_delay_passes=st.integers(1, 8),
        token_usage_low_watermark=st.none() | st.floats(0.0, 1.0) if watermark else st.none(),
        queue_min_ratio=(st.floats(0.25, 1.0) if queue else st.none() if queue is False
                         else st.none() | ratios),
        max_delay_ms=st.floats(1.0, 500.0),
        mode=st.just(mode) if mode else st.sampled_from(["sglang", "bounded"]),
    )


def delayer_rows(prefillable: bool | None = None) -> st.SearchStrategy[list[int]]:
    """Hand-made 5-field gathered rows. The watermark column is free (even where no real rank
    would set it), to check that the decision copes with any table."""
    return st.tuples(
        st.just(int(prefillable)) if prefillable is not None else st.integers(0, 1),
        st.integers(0, 1), st.integers(0, 20), st.integers(0, 8), st.integers(0, 10),
    ).map(list)


@st.composite
def delayer_passes(draw: st.DrawFn, max_dp: int = 4) -> DelayerScenario:
    """1..25 passes of 1..``max_dp`` ranks' inputs, with clock steps of 0..200 ms."""
    dp = draw(st.integers(1, max_dp))
    rank_input = st.tuples(st.booleans(), st.floats(0.0, 1.0), st.integers(0, 20),
                           st.integers(0, 8), st.integers(0, 10))
    passes = draw(st.lists(st.tuples(st.lists(rank_input, min_size=dp, max_size=dp),
                                     st.integers(0, 40)), min_size=1, max_size=25))
    steps = draw(st.lists(st.floats(0.0, 0.2), min_size=len(passes), max_size=len(passes)))
    return passes, steps


@st.composite
def chunked_prompts(draw: st.DrawFn, max_len: int = 120) -> tuple[int, int, list[int]]:
    """``(page_size, length, progress)``: a prompt of ``length`` tokens computed in chunks,
    ``progress`` the tokens computed after each chunk (increasing, the last is ``length``),
    cut anywhere, not only at page boundaries."""
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    length = draw(st.integers(min_value=1, max_value=max_len))
    cuts = draw(st.lists(st.integers(min_value=1, max_value=length), max_size=6, unique=True))
    return page_size, length, sorted({*cuts, length})
