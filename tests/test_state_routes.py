"""Who sends which state bytes to whom between parallel layouts (kv/state_routes.py), over every
TP pairing up to 8 ranks: every decode rank's recurrent channels are written exactly once, by
exactly its contacts; the index comes from one of its KV sources; the draft and SWA pools go
as the full pages; stages must tile a pool's layers; shapes scale with the layout."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kv.layouts import TPLayout, plan_slices
from kv.routes import SenderDuty
from kv.state_routes import decode_shape, stage_gaps, state_duty, state_sources
from kv.state_shapes import StateShape

POOLS = ("draft", "swa", "recurrent", "index")


@st.composite
def layouts(draw: st.DrawFn) -> tuple[TPLayout, TPLayout, int]:
    """Two TP layouts of one model (sizes that divide one another) and a recurrent width that
    splits over both."""
    tp, td = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    width = max(tp, td) * draw(st.integers(1, 3))
    return TPLayout(tp, heads), TPLayout(td, heads), width


@given(layouts())
def test_every_decode_channel_is_written_once_by_its_contacts(
        case: tuple[TPLayout, TPLayout, int]) -> None:
    prefill, decode, width = case
    plan = plan_slices(prefill, decode)
    layers = {name: range(2) for name in POOLS}
    for d in range(decode.tp_size):
        written: list[int] = []
        writers, index_from = set(), []
        for p in range(prefill.tp_size):
            duty = state_duty(SenderDuty(plan, p, range(3)), layers, width // prefill.tp_size)
            shares = {s.name: s for s in duty.shares(d)}
            if "recurrent" in shares:
                r = shares["recurrent"]
                assert len(r.src_cols) == len(r.dst_cols) > 0
                assert r.src_cols.stop <= width // prefill.tp_size
                written += list(r.dst_cols)
                writers.add(p)
            if "index" in shares:
                index_from.append(p)
            for name in ("draft", "swa"):
                assert (shares[name].heads if name in shares else ()) == plan.between(p, d)
            assert not duty.status_only
        assert sorted(written) == list(range(width // decode.tp_size))
        assert tuple(sorted(writers)) == plan.contacts(d) == state_sources(plan, d, POOLS)
        assert len(index_from) == 1 and index_from[0] in plan.sources(d)
        assert state_sources(plan, d, ("draft", "swa", "index")) == plan.sources(d)


def test_stages_must_hold_each_layer_of_a_pool_once() -> None:
    decode = {"recurrent": range(4), "swa": range(2)}
    tiled = [{"recurrent": range(0, 2), "swa": range(0, 1)},
             {"recurrent": range(2, 4), "swa": range(1, 2)}]
    assert stage_gaps(tiled, decode) == []
    # One prefill stage: no stages to speak of (a smaller pool, as state_mismatches words it).
    assert stage_gaps([tiled[0]], decode) == [
        "recurrent layers: prefill 0..2 vs decode 4",
        "swa layers: prefill 0..1 vs decode 2"]
    assert stage_gaps([tiled[1], {"swa": range(2, 3)}], decode) == [
        "recurrent layers: the prefill stages hold 2..4 of the decode's 4",
        "swa layers: the prefill stages hold 1..2, 2..3 of the decode's 2"]
    assert stage_gaps([tiled[0], tiled[0]], {"swa": range(2)}) == [
        "swa layers: the prefill stages hold 0..1, 0..1 of the decode's 2"]


def test_a_prefill_pool_is_compared_as_the_decode_rank_would_hold_it() -> None:
    plan = plan_slices(TPLayout(2, 4), TPLayout(1, 4))
    swa = StateShape(regions=2, items=9, item_len=48, dtype="float32", layout="layer_major")
    # A stage holding one of two SWA layers, two of four heads -> the whole pool's pages.
    assert decode_shape(swa, "swa", range(1, 2), 2, plan) == StateShape(
        regions=4, items=9, item_len=96, dtype="float32", layout="layer_major")
    paged = StateShape(regions=1, items=9, item_len=48, dtype="float32", layout="page_major")
    assert decode_shape(paged, "draft", range(0, 1), 2, plan).item_len == 192
    rec = StateShape(regions=1, items=3, item_len=32, dtype="int64")
    assert decode_shape(rec, "recurrent", range(1, 2), 2, plan) == StateShape(
        regions=2, items=3, item_len=64, dtype="int64")
    same = plan_slices(TPLayout(2, 4), TPLayout(2, 4))
    assert decode_shape(swa, "swa", range(2), 2, same) == swa
