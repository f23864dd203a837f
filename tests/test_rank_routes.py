"""Rank registration (kv.rank_table) at the bootstrap endpoint, and the decode side's route to the
prefill ranks (kv.routes): places, refusals naming both values, contacts and sources per stage."""

from __future__ import annotations

import json
from collections.abc import Iterator

import attrs
import pytest

from kv.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from kv.layouts import TPLayout
from kv.rank_table import RankInfo, RankPlace
from kv.routes import DecodeRank, IncompatibleRanksError, route, sender_duty

LAYERS = 5


def _place(tp: int, tp_size: int, pp: int = 0, pp_size: int = 1, dp: int = 0, dp_size: int = 1,
           heads: int = 8, mla: bool = False) -> RankPlace:
    return RankPlace(tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, dp_rank=dp,
                     dp_size=dp_size, kv_heads=heads, mla=mla, num_layers=LAYERS,
                     layer_start=pp * LAYERS // pp_size, layer_stop=(pp + 1) * LAYERS // pp_size)


def _info(place: RankPlace, head_dim: int = 16, page_size: int = 4) -> RankInfo:
    return RankInfo(rank=place.rank, endpoint=f"tcp://127.0.0.1:{7000 + place.rank}",
                    session=f"127.0.0.1:{8000 + place.rank}", page_size=page_size,
                    kv_dtype="bfloat16", model="m", head_dim=head_dim, place=place)


def _mesh(tp_size: int, pp_size: int = 1, dp_size: int = 1, heads: int = 8) -> list[RankInfo]:
    return [_info(_place(t, tp_size, s, pp_size, d, dp_size, heads))
            for d in range(dp_size) for s in range(pp_size) for t in range(tp_size)]


def _decode(tp: int, tp_size: int, heads: int = 8, head_dim: int = 16,
            page_size: int = 4) -> DecodeRank:
    return DecodeRank(page_size=page_size, kv_dtype="bfloat16", kv_layout="layer_major",
                      head_dim=head_dim, model="m",
                      place=_place(tp, tp_size, heads=heads))


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer(expected_ranks=4)
    yield srv
    srv.close()


def test_a_tp2_pp2_mesh_registers_and_the_table_carries_every_place(
        server: BootstrapServer) -> None:
    client = BootstrapClient(server.address)
    mesh = _mesh(2, 2)
    assert [r.rank for r in mesh] == [0, 1, 2, 3]
    for info in reversed(mesh):
        client.register(info)
    table = client.lookup()
    assert table.ranks == tuple(mesh)
    assert [(r.place.pp_rank, r.place.tp_rank, r.place.layers) for r in table.ranks] == [
        (0, 0, range(0, 2)), (0, 1, range(0, 2)), (1, 0, range(2, 5)), (1, 1, range(2, 5))]
    client.register(mesh[1])  # a restarted rank registers again


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (attrs.evolve(_mesh(2, 2)[1], head_dim=8),
         "rank 1 has head_dim=8 but rank 0 has head_dim=16"),
        (attrs.evolve(_mesh(2, 2)[1], page_size=16),
         "rank 1 has page_size=16 but rank 0 has page_size=4"),
        (attrs.evolve(_mesh(2, 2)[1], rank=2), "rank 2 is at tp_rank=1 pp_rank=0 dp_rank=0, "
         "which is rank 1"),
        (_info(_place(1, 2, heads=4, pp_size=2)),
         "rank 1 has kv_heads=4 but rank 0 has kv_heads=8"),
        (attrs.evolve(_mesh(2, 2)[1], model="other"),
         "rank 1 serves model other but rank 0 serves m"),
        (_info(attrs.evolve(_place(1, 2, pp_size=2), layer_stop=3)),
         r"rank 1 \(stage 0\) holds layers 0..3 but rank 0 \(stage 0\) holds 0..2"),
        (_info(attrs.evolve(_place(1, 2, pp=1, pp_size=2), layer_start=3)),
         r"rank 3 \(stage 1\) holds layers 3..5 but rank 0 \(stage 0\) holds 0..2"),
        (_info(_place(1, 2, dp_size=4)),
         r"names a mesh of tp_size=2 pp_size=1 dp_size=4 \(8 ranks\), the endpoint expects 4"),
        (_info(_place(1, 4)),
         "rank 1 has tp_size=4 pp_size=1 but rank 0 has tp_size=2 pp_size=2"),
    ],
    ids=["head_dim", "page_size", "rank-vs-place", "kv_heads", "model", "stage-layers",
         "stage-gap", "world-size", "mesh-sizes"],
)
def test_a_registration_that_disagrees_is_refused_naming_both(
        server: BootstrapServer, bad: RankInfo, message: str) -> None:
    client = BootstrapClient(server.address)
    client.register(_mesh(2, 2)[0])
    with pytest.raises(BootstrapError, match=message) as err:
        client.register(bad)
    assert err.value.status == 400
    assert set(server.ranks()) == {0}


def test_the_first_stage_starts_at_layer_0_and_the_last_ends_at_the_last() -> None:
    srv = BootstrapServer(expected_ranks=2)
    try:
        client = BootstrapClient(srv.address)
        late = _info(attrs.evolve(_place(0, 1, pp=1, pp_size=2), layer_stop=4))
        with pytest.raises(BootstrapError, match=r"stage 1 of 2 but holds layers 2\.\.4 of 5"):
            client.register(late)
    finally:
        srv.close()


def test_json_places_are_strict() -> None:
    body = json.loads(json.dumps(attrs.asdict(_mesh(2)[0])))
    assert RankInfo.from_json(body) == _mesh(2)[0]
    for place in ({**body["place"], "tp_rank": True}, {**body["place"], "extra": 1},
                  {k: v for k, v in body["place"].items() if k != "mla"},
                  {**body["place"], "mla": 1}, {**body["place"], "tp_rank": 2}):
        with pytest.raises((TypeError, ValueError)):
            RankInfo.from_json({**body, "place": place})


def test_a_decode_rank_contacts_and_waits_for_every_stage() -> None:
    mesh = _mesh(4, 2)  # prefill TP 4 x PP 2, eight heads
    r = route(mesh, _decode(1, 2), room=7)  # decode TP 2, rank 1: heads 4..7
    assert r.dp_rank == 0
    assert [(s.stage, s.layers) for s in r.stages] == [(0, range(0, 2)), (1, range(2, 5))]
    assert [[c.rank for c in s.contacts] for s in r.stages] == [[2, 3], [6, 7]]
    assert [[c.rank for c in s.sources] for s in r.stages] == [[2, 3], [6, 7]]
    assert len(r.sources) == 4

    gqa = route(_mesh(4, 1, heads=2), _decode(0, 1, heads=2), room=0)
    # Two heads on four prefill ranks: the first replica of each writes, all four are told.
    assert [c.rank for c in gqa.contacts] == [0, 1, 2, 3]
    assert [c.rank for c in gqa.sources] == [0, 2]

    wide = route(_mesh(1, 2), _decode(3, 4), room=0)  # TP 1 -> TP 4: one source per stage
    assert [c.rank for c in wide.sources] == [0, 1]


def test_a_room_goes_to_its_dp_replica() -> None:
    mesh = _mesh(2, 1, dp_size=3)
    for room in (0, 4, 11):
        r = route(mesh, _decode(0, 1), room=room)
        assert r.dp_rank == room % 3
        assert [c.rank for c in r.sources] == [2 * (room % 3), 2 * (room % 3) + 1]


@pytest.mark.parametrize(
    ("decode", "message"),
    [
        (_decode(0, 1, head_dim=8), "head_dim: prefill 16 vs decode 8"),
        (_decode(0, 1, page_size=2), "page_size: prefill 4 vs decode 2"),
        (_decode(0, 1, heads=4), "kv_heads: prefill 8 vs decode 4"),
        (_decode(0, 3, heads=3), "kv_heads: prefill 8 vs decode 3"),
        (attrs.evolve(_decode(0, 1), model="x"), "model: prefill m vs decode x"),
    ],
    ids=["head_dim", "page_size", "kv_heads", "tp3", "model"],
)
def test_a_decode_rank_that_does_not_match_is_refused_naming_both(
        decode: DecodeRank, message: str) -> None:
    with pytest.raises(IncompatibleRanksError, match=message):
        route(_mesh(2), decode, room=0)


def test_tp_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(IncompatibleRanksError, match="tp_size 2 and decode tp_size 3"):
        route(_mesh(2, heads=6), _decode(0, 3, heads=6), room=0)


def test_a_sender_knows_its_destinations_slices_and_layers() -> None:
    duty = sender_duty(_place(1, 2, pp=1, pp_size=2), _place(0, 4))
    assert duty.destinations == (2, 3)
    assert duty.layers == range(2, 5)
    assert not duty.status_only and not duty.whole_pages(2)
    assert [s.dst_heads for s in duty.slices(3)] == [range(0, 2)]
    mla = sender_duty(_place(1, 2, heads=1, mla=True), _place(0, 1, heads=1, mla=True))
    assert mla.status_only and mla.destinations == (0,)
    assert sender_duty(_place(0, 2), _place(0, 2)).whole_pages(0)
    assert duty.plan.prefill == TPLayout(2, 8)
