"""The TP slice plan (kv.layouts): which heads go from which prefill rank to which decode rank,
who contacts whom, and what completes a room."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given

from kv.layouts import LayoutError, SlicePlan, TPLayout, plan_slices
from tests.strategies import layout_pairs


def _plan(tp: int, td: int, heads: int, mla: bool = False) -> SlicePlan:
    return plan_slices(TPLayout(tp, heads, mla), TPLayout(td, heads, mla))


def _table(plan: SlicePlan) -> list[tuple[int, int, list[int]]]:
    return [(s.prefill_rank, s.decode_rank, list(s.heads)) for s in plan.slices]


# -- layouts worked by hand ---------------------------------------------------------------------


def test_rank_heads_split_replicate_and_mla() -> None:
    assert [list(TPLayout(4, 8).heads_of(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(TPLayout(4, 2).heads_of(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(TPLayout(4, 1, mla=True).heads_of(r)) for r in range(4)] == [[0]] * 4
    assert list(TPLayout(4, 2).holders(1)) == [2, 3]
    assert TPLayout(4, 2).heads_per_rank == 1
    assert TPLayout(2, 8).heads_per_rank == 4


def test_prefill_tp4_to_decode_tp2_gathers_two_prefill_ranks_per_decode_rank() -> None:
    plan = _plan(4, 2, 8)
    assert _table(plan) == [(0, 0, [0, 1]), (1, 0, [2, 3]), (2, 1, [4, 5]), (3, 1, [6, 7])]
    assert [s.dst_heads for s in plan.receives(0)] == [range(0, 2), range(2, 4)]
    assert [s.src_heads for s in plan.receives(0)] == [range(0, 2)] * 2
    assert plan.sources(1) == (2, 3)  # decode rank 1 completes after two successes
    assert plan.contacts(1) == (2, 3)
    assert [plan.destinations(p) for p in range(4)] == [(0,), (0,), (1,), (1,)]
    assert not any(plan.whole_pages(s.prefill_rank, s.decode_rank) for s in plan.slices)


def test_prefill_tp2_to_decode_tp4_splits_each_prefill_rank_over_two_decode_ranks() -> None:
    plan = _plan(2, 4, 8)
    assert _table(plan) == [(0, 0, [0, 1]), (0, 1, [2, 3]), (1, 2, [4, 5]), (1, 3, [6, 7])]
    assert [s.src_heads for s in plan.sends(0)] == [range(0, 2), range(2, 4)]
    assert [s.dst_heads for s in plan.sends(0)] == [range(0, 2)] * 2
    assert plan.destinations(1) == (2, 3)  # prefill rank 1 waits for two destinations
    assert [plan.sources(d) for d in range(4)] == [(0,), (0,), (1,), (1,)]


def test_same_tp_sends_whole_pages_rank_to_rank() -> None:
    plan = _plan(2, 2, 8)
    assert _table(plan) == [(0, 0, [0, 1, 2, 3]), (1, 1, [4, 5, 6, 7])]
    assert plan.whole_pages(0, 0) and plan.whole_pages(1, 1)
    assert not plan.whole_pages(0, 1)


def test_gqa_replicas_on_prefill_send_each_head_once() -> None:
    # 2 KV heads over 4 prefill ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1. The one
    # decode rank takes each head from its first replica; ranks 1 and 3 only report status.
    plan = _plan(4, 1, 2)
    assert _table(plan) == [(0, 0, [0]), (2, 0, [1])]
    assert plan.sources(0) == (0, 2)
    assert plan.contacts(0) == (0, 1, 2, 3)
    assert [plan.status_only(p) for p in range(4)] == [False, True, False, True]


def test_gqa_replicas_on_both_sides_spread_over_prefill_replicas() -> None:
    # 2 heads, prefill TP 4 (2 replicas a head), decode TP 2 (1 holder a head).
    assert _table(_plan(4, 2, 2)) == [(0, 0, [0]), (2, 1, [1])]
    # 1 head, prefill TP 2, decode TP 4: each prefill replica feeds two decode ranks.
    plan = _plan(2, 4, 1)
    assert _table(plan) == [(0, 0, [0]), (0, 1, [0]), (1, 2, [0]), (1, 3, [0])]


def test_mla_one_prefill_rank_per_decode_rank_others_status_only() -> None:
    plan = _plan(4, 2, 1, mla=True)
    assert _table(plan) == [(0, 0, [0]), (2, 1, [0])]
    assert [plan.sources(d) for d in range(2)] == [(0,), (2,)]
    assert [plan.status_only(p) for p in range(4)] == [False, True, False, True]
    assert plan.contacts(0) == (0, 1)
    assert plan.whole_pages(0, 0)
    widen = _plan(1, 4, 1, mla=True)
    assert [widen.sources(d) for d in range(4)] == [(0,)] * 4
    assert widen.destinations(0) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: TPLayout(4, 6), "kv_heads 6 and tp_size 4"),
        (lambda: TPLayout(0, 8), "tp_size must be >= 1, got 0"),
        (lambda: _plan(4, 3, 12), "prefill tp_size 4 and decode tp_size 3"),
        (lambda: plan_slices(TPLayout(2, 8), TPLayout(2, 4)), "prefill holds 8 KV heads"),
        (lambda: TPLayout(2, 8).heads_of(2), "rank 2 is not in TP size 2"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_values(build: object, named: str) -> None:
    with pytest.raises(LayoutError, match=named):
        build()  # type: ignore[operator]


# -- invariants over random layouts -------------------------------------------------------------


@given(layout_pairs())
def test_every_decode_head_is_written_exactly_once(layouts: tuple[TPLayout, TPLayout]) -> None:
    plan = plan_slices(*layouts)
    for d in range(plan.decode.tp_size):
        written = Counter(h for s in plan.receives(d) for h in s.heads)
        assert sorted(written.elements()) == list(plan.decode.heads_of(d))


@given(layout_pairs())
def test_slices_name_the_heads_where_each_side_keeps_them(
    layouts: tuple[TPLayout, TPLayout],
) -> None:
    plan = plan_slices(*layouts)
    for s in plan.slices:
        src_rank_heads = plan.prefill.heads_of(s.prefill_rank)
        dst_rank_heads = plan.decode.heads_of(s.decode_rank)
        assert [src_rank_heads[i] for i in s.src_heads] == list(s.heads)
        assert [dst_rank_heads[i] for i in s.dst_heads] == list(s.heads)
        assert len(s.heads) > 0


@given(layout_pairs())
def test_contacts_destinations_and_completion_counts_agree(
    layouts: tuple[TPLayout, TPLayout],
) -> None:
    plan = plan_slices(*layouts)
    tp, td = plan.prefill.tp_size, plan.decode.tp_size
    for d in range(td):
        # A decode rank hears success from every sender, and each sender has its destination.
        assert set(plan.sources(d)) <= set(plan.contacts(d))
        assert plan.sources(d) == tuple(sorted({s.prefill_rank for s in plan.receives(d)}))
        if plan.decode.mla:
            assert len(plan.sources(d)) == 1
        elif plan.prefill.kv_heads >= max(tp, td):
            assert len(plan.sources(d)) == max(1, tp // td)  # SGLang's response count
    for p in range(tp):
        dests = plan.destinations(p)
        assert len(dests) == max(1, td // tp)  # SGLang's required_dst_info_num
        assert dests == tuple(d for d in range(td) if p in plan.contacts(d))
        # A prefill rank writes to every decode rank it waits for, or to none.
        sent_to = {s.decode_rank for s in plan.sends(p)}
        assert sent_to in (set(dests), set())
        assert plan.status_only(p) == (not sent_to)


@given(layout_pairs())
def test_replicas_share_the_sending_evenly(layouts: tuple[TPLayout, TPLayout]) -> None:
    plan = plan_slices(*layouts)
    for h in range(plan.prefill.kv_heads):
        senders = plan.prefill.holders(h)
        receivers = plan.decode.holders(h)
        per_sender = Counter(s.prefill_rank for s in plan.slices if h in s.heads)
        assert sum(per_sender.values()) == len(receivers)
        assert set(per_sender) <= set(senders)
        assert max(per_sender.values()) == -(-len(receivers) // len(senders))
