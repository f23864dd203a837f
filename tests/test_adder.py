"""The PrefillAdder's budgets: SGLang's rules on the prefill server."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kv.pages import pages_needed
from lifecycle import PrefillRequest
from scheduler.prefill.adder import Stop, plan_batch


def req(n: int, rid: str = "r", scheduled: int = 0, pages: int = 0) -> PrefillRequest:
    r = PrefillRequest(rid, input_ids=tuple(range(n)))
    r.scheduled = scheduled
    r.pages = list(range(pages))
    return r


def plan(waiting, continuing=None, **kw):
    args = dict(
        continuing=continuing,
        waiting=waiting,
        waiting_len=len(waiting),
        running=0,
        free_pages=1000,
        page_size=16,
        max_prefill_tokens=16384,
        chunked_prefill_size=None,
        max_running_requests=256,
        prefill_max_requests=None,
    )
    args.update(kw)
    return plan_batch(**args)


def test_whole_requests_until_the_input_budget():
    p = plan([req(100, "a"), req(100, "b"), req(100, "c")], max_prefill_tokens=220)
    assert [c.req.rid for c in p.chunks] == ["a", "b"]
    assert [(c.start, c.length, c.new_pages) for c in p.chunks] == [(0, 100, 7), (0, 100, 7)]
    assert p.stop is Stop.BUDGET


def test_first_request_is_always_admitted_past_max_prefill_tokens():
    p = plan([req(5000, "a"), req(10, "b")], max_prefill_tokens=1000)
    assert [(c.req.rid, c.length) for c in p.chunks] == [("a", 5000)]


def test_chunks_are_cut_at_page_boundaries_and_stop_the_batch():
    p = plan([req(1000, "a"), req(10, "b")], chunked_prefill_size=100)
    assert [(c.req.rid, c.start, c.length, c.last) for c in p.chunks] == [("a", 0, 96, False)]
    assert p.stop is Stop.BUDGET


def test_a_chunked_request_continues_first():
    a = req(200, "a", scheduled=96, pages=6)
    p = plan([req(10, "b")], continuing=a, chunked_prefill_size=128)
    assert [(c.req.rid, c.start, c.length, c.new_pages) for c in p.chunks] == [
        ("a", 96, 104, 7),
        ("b", 0, 10, 1),
    ]
    assert p.chunks[0].last


def test_no_pages_without_chunking_waits():
    p = plan([req(100, "a")], free_pages=3)
    assert p.chunks == [] and p.stop is Stop.NO_PAGES


def test_no_pages_with_chunking_fits_what_the_pool_holds():
    p = plan([req(100, "a")], free_pages=3, chunked_prefill_size=1000)
    assert [(c.length, c.new_pages, c.last) for c in p.chunks] == [(48, 3, False)]


def test_max_running_and_batch_caps():
    p = plan([req(1, str(i)) for i in range(10)], running=250)
    assert len(p.chunks) == 6 and p.stop is Stop.MAX_RUNNING
    p = plan([req(1, str(i)) for i in range(10)], prefill_max_requests=3)
    assert len(p.chunks) == 3 and p.stop is Stop.MAX_BATCH


def test_gate_is_asked_once_and_can_delay():
    asked = []

    def gate(running: int, waiting_len: int) -> bool:
        asked.append((running, waiting_len))
        return False

    p = plan([req(1, "a"), req(1, "b")], gate=gate, running=4)
    assert p.chunks == [] and p.stop is Stop.DELAYED
    assert asked == [(4, 2)]
    asked.clear()
    p = plan([req(1, "a"), req(1, "b")], gate=lambda r, w: asked.append(r) or True)
    assert len(p.chunks) == 2 and len(asked) == 1


@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
    page_size=st.sampled_from([1, 16, 64]),
    chunk=st.one_of(st.none(), st.integers(1, 40).map(lambda k: k * 64)),
    free=st.integers(0, 200),
    budget=st.integers(1, 8192),
)
def test_plans_respect_every_budget(lengths, page_size, chunk, free, budget):
    waiting = [req(n, str(i)) for i, n in enumerate(lengths)]
    p = plan(waiting, page_size=page_size, chunked_prefill_size=chunk, free_pages=free,
             max_prefill_tokens=budget)
    assert sum(c.new_pages for c in p.chunks) <= free
    for c in p.chunks:
        assert c.length > 0
        assert c.new_pages == pages_needed(c.start + c.length, page_size) - len(c.req.pages)
        if not c.last:
            assert (c.start + c.length) % page_size == 0  # cut at a page boundary
    if chunk is not None:
        assert p.num_tokens <= chunk
    if len(p.chunks) > 1:
        assert p.num_tokens <= budget
    # At most one request is left mid-chunk, and it is the last of the batch.
    assert all(c.last for c in p.chunks[:-1])
