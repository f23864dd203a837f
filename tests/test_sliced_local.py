"""The local backend between ranks of different parallel layouts, in one process (one manager per
rank): random whole-model KV lands byte-exact on every decode rank for prefill TP {1, 2, 4} x
decode TP {1, 2, 4}, GQA replicas, MLA and prefill PP 2 -> decode PP 1; registrations that
disagree are refused naming both values; a failure on one rank fails the room on every rank,
and once every end is cleared no record of the room is left on either side."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

from kv.local import LocalKVManager, LocalKVSender, LocalTransferHub
from kv.local_decode import LocalDecodeManager, LocalKVReceiver
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError, KVPool
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.transfer import (
    REASON_ABORTED,
    REASON_OTHER_RANK,
    REASON_PEER_ABORTED,
    KVPoll,
)
from tests.transfer_harness import drive, eventually

ADDR = "local:sliced"
PAGE_SIZE, HEAD_DIM, NUM_PAGES = 2, 4, 24
_TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}
SRC_PAGES = [3, 4, 5, 9, 10, 20]


def _place(tp: int, tp_size: int, *, heads: int, layers: int, pp: int = 0, pp_size: int = 1,
           dp: int = 0, dp_size: int = 1, mla: bool = False) -> RankPlace:
    return RankPlace(tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, dp_rank=dp,
                     dp_size=dp_size, kv_heads=heads, mla=mla, num_layers=layers,
                     layer_start=pp * layers // pp_size, layer_stop=(pp + 1) * layers // pp_size)


def _pool(place: RankPlace, layout: KVLayout, seed: int, **over: Any) -> KVPool:
    kwargs: dict[str, Any] = {
        "num_layers": len(place.layers), "num_pages": NUM_PAGES, "page_size": PAGE_SIZE,
        "kv_heads": place.heads_per_rank, "head_dim": HEAD_DIM, "dtype": torch.bfloat16,
        "model": "m", "layout": layout, **over}
    pool = KVPool(**kwargs)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


@attrs.define
class Pair:
    """Every rank of a prefill server and of a decode server, over one hub."""

    hub: LocalTransferHub
    prefill: list[LocalKVManager]
    decode: list[LocalDecodeManager]
    #: ``[layers, 2, pages, page_size, heads, head_dim]``: the model's KV at SRC_PAGES, of
    #: which every prefill rank holds its heads of its stage's layers (replicas alike).
    model_kv: torch.Tensor

    def close(self) -> None:
        for m in self.prefill:
            m.close()

    def leaks(self) -> list[str]:
        out = [f"prefill rank {m.rank} keeps {m.live_rooms()} senders"
               for m in self.prefill if m.live_rooms()]
        if self.hub.open_rooms(ADDR):
            out.append(f"the server keeps {self.hub.open_rooms(ADDR)} rooms")
        return out


def _pair(tp: int, td: int, *, heads: int = 8, layers: int = 3, pp: int = 1, dp: int = 1,
          mla: bool = False, layout: KVLayout = KVLayout.LAYER_MAJOR) -> Pair:
    hub = LocalTransferHub()
    model_kv = torch.randn((layers, 2, len(SRC_PAGES), PAGE_SIZE, heads, HEAD_DIM),
                           generator=torch.Generator().manual_seed(tp * 100 + td)
                           ).to(torch.bfloat16)
    prefill = []
    for d in range(dp):
        for s in range(pp):
            for t in range(tp):
                place = _place(t, tp, heads=heads, layers=layers, pp=s, pp_size=pp, dp=d,
                               dp_size=dp, mla=mla)
                pool = _pool(place, layout, seed=place.rank)
                held = place.tp_layout.heads_of(t)
                pool.by_layer()[:, :, SRC_PAGES] = model_kv[
                    place.layer_start : place.layer_stop, :, :, :, held.start : held.stop]
                prefill.append(LocalKVManager(pool, MetadataBuffers(4), hub=hub,
                                              bootstrap_addr=ADDR, place=place))
    decode = []
    for t in range(td):
        place = _place(t, td, heads=heads, layers=layers, mla=mla)
        decode.append(LocalDecodeManager(_pool(place, layout, seed=100 + t), MetadataBuffers(4),
                                         hub=hub, place=place))
    return Pair(hub, prefill, decode, model_kv)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _dst_pages(d: int) -> list[int]:
    """Each decode rank's destination: other pages than its neighbours', in other runs."""
    return [(7 * d + 2 * i + 1) % NUM_PAGES for i in range(len(SRC_PAGES))]


def _receivers(pair: Pair, room: int) -> list[LocalKVReceiver]:
    out = []
    for d, manager in enumerate(pair.decode):
        receiver = manager.create_receiver(ADDR, room)
        receiver.init()
        receiver.send_metadata(_dst_pages(d), slot=d % 4)
        out.append(receiver)
    return out


def _serving(pair: Pair, room: int) -> list[LocalKVManager]:
    """The prefill ranks of the DP replica that serves ``room``."""
    return [m for m in pair.prefill if m.place.dp_rank == room % m.place.dp_size]


def _transfer(pair: Pair, room: int) -> tuple[list[LocalKVSender], list[LocalKVReceiver]]:
    """Run ``room`` through every rank: every sender created and paired before any sends, as
    the prefill TP ranks' agreement makes the scheduler do."""
    serving = _serving(pair, room)
    senders = [m.create_sender(ADDR, room) for m in serving]
    receivers = _receivers(pair, room)
    for m, s in zip(serving, senders, strict=True):
        assert drive(m, s, {KVPoll.WAITING_FOR_INPUT}) == [KVPoll.WAITING_FOR_INPUT]
        s.init(len(SRC_PAGES), 2)
        m.metadata.write(2, first_token=42, cached_tokens=1, logprob=None, room=room)
        s.send(SRC_PAGES[:4], last=False)
        s.send(SRC_PAGES[4:], last=True)
    for m, s in zip(serving, senders, strict=True):
        assert drive(m, s, _TERMINAL)[-1] == KVPoll.SUCCESS
    for r in receivers:
        eventually(lambda r=r: r.poll().terminal, "a receiver to conclude")  # type: ignore[misc]
    return senders, receivers


def _check_landed(pair: Pair, room: int, before: list[torch.Tensor]) -> None:
    kv = pair.model_kv
    for d, manager in enumerate(pair.decode):
        held = manager.place.tp_layout.heads_of(d)
        landed = manager.pool.by_layer()
        pages = _dst_pages(d)
        assert torch.equal(_bits(landed[:, :, pages]),
                           _bits(kv[:, :, :, :, held.start : held.stop])), f"decode rank {d}"
        others = [p for p in range(NUM_PAGES) if p not in pages]
        assert torch.equal(_bits(landed[:, :, others]), _bits(before[d][:, :, others]))
        row = manager.metadata.read(d % 4, expected_room=room)
        assert row is not None and row.first_token == 42


def _run(pair: Pair, room: int = 77) -> tuple[list[LocalKVSender], list[LocalKVReceiver]]:
    before = [m.pool.by_layer().clone() for m in pair.decode]
    senders, receivers = _transfer(pair, room)
    assert [r.poll() for r in receivers] == [KVPoll.SUCCESS] * len(receivers)
    _check_landed(pair, room, before)
    for end in [*senders, *receivers]:
        assert end.quiescent()
        end.clear()
    assert pair.leaks() == []
    return senders, receivers


@pytest.fixture
def closing() -> Iterator[list[Pair]]:
    pairs: list[Pair] = []
    yield pairs
    for p in pairs:
        p.close()


@pytest.mark.parametrize("td", [1, 2, 4])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_heads_land_byte_exact(closing: list[Pair], tp: int, td: int) -> None:
    pair = _pair(tp, td)
    closing.append(pair)
    _run(pair)


@pytest.mark.parametrize(("tp", "td"), [(4, 2), (1, 2)])
def test_split_heads_land_byte_exact_page_major(closing: list[Pair], tp: int, td: int) -> None:
    pair = _pair(tp, td, layout=KVLayout.PAGE_MAJOR)
    closing.append(pair)
    _run(pair)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize(("tp", "td"), [(4, 1), (4, 2), (1, 4), (2, 4)])
def test_gqa_replicas_land_byte_exact(closing: list[Pair], tp: int, td: int, heads: int) -> None:
    pair = _pair(tp, td, heads=heads)
    closing.append(pair)
    _run(pair)
    # A replica no decode rank takes its head from writes nothing and reports status only.
    if tp > td and tp > heads:
        assert min(m.stats().chunks for m in pair.prefill) == 0


@pytest.mark.parametrize(("tp", "td"), [(4, 1), (2, 2), (1, 4)])
def test_mla_latent_lands_from_one_rank_each(closing: list[Pair], tp: int, td: int) -> None:
    pair = _pair(tp, td, heads=1, mla=True)
    closing.append(pair)
    _run(pair)
    writers = [m.rank for m in pair.prefill if m.stats().chunks]
    assert writers == [p for p in range(tp) if p % max(1, tp // td) == 0]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("tp", "td"), [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_two_prefill_stages_land_their_layers_on_one_decode_stage(
        closing: list[Pair], tp: int, td: int, layout: KVLayout) -> None:
    pair = _pair(tp, td, layers=5, pp=2, layout=layout)  # stages of 2 and 3 layers
    closing.append(pair)
    _run(pair)
    assert all(m.stats().chunks for m in pair.prefill)


def test_dp_replicas_each_serve_their_rooms(closing: list[Pair]) -> None:
    pair = _pair(2, 1, dp=2)
    closing.append(pair)
    for room in (10, 11):
        _run(pair, room)
    assert [m.stats().chunks for m in pair.prefill] == [2, 2, 2, 2]


# -- refusals ---------------------------------------------------------------------------------


def _manager(hub: LocalTransferHub, place: RankPlace, **over: Any) -> LocalKVManager:
    return LocalKVManager(_pool(place, KVLayout.LAYER_MAJOR, 0, **over), MetadataBuffers(2),
                          hub=hub, bootstrap_addr=ADDR, place=place)


@pytest.mark.parametrize(
    ("second", "over", "message"),
    [
        (_place(1, 2, heads=8, layers=3), {"head_dim": 8},
         "rank 1 has head_dim=8 but rank 0 has head_dim=4"),
        (_place(1, 2, heads=8, layers=3), {"page_size": 4},
         "rank 1 has page_size=4 but rank 0 has page_size=2"),
        (_place(1, 2, heads=4, layers=3), {}, "rank 1 has kv_heads=4 but rank 0 has kv_heads=8"),
        (_place(1, 2, heads=8, layers=3), {"model": "other"},
         "rank 1 serves model other but rank 0 serves m"),
        (_place(0, 2, heads=8, layers=3), {}, "already registered .* as rank 0"),
        (_place(1, 2, heads=8, layers=3), {"kv_heads": 2}, "its pool holds 2 heads of 3 layers, "
         "its place 4 heads of 3 layers"),
    ],
    ids=["head_dim", "page_size", "kv_heads", "model", "twice", "pool-vs-place"],
)
def test_a_rank_that_disagrees_is_refused_naming_both(
        second: RankPlace, over: dict[str, Any], message: str) -> None:
    hub = LocalTransferHub()
    first = _manager(hub, _place(0, 2, heads=8, layers=3))
    try:
        with pytest.raises(ValueError, match=message):
            _manager(hub, second, **over)
    finally:
        first.close()


@pytest.mark.parametrize(
    ("decode", "over", "message"),
    [
        (_place(0, 1, heads=8, layers=3), {"head_dim": 8}, r"head_dim: 4 vs 8 \(prefill vs"),
        (_place(0, 1, heads=8, layers=3), {"page_size": 4}, r"page_size: 2 vs 4 \(prefill vs"),
        (_place(0, 1, heads=4, layers=3), {}, "kv_heads: prefill 8 vs decode 4"),
        (_place(0, 1, heads=8, layers=4), {}, "num_layers: prefill 3 vs decode 4"),
        (_place(0, 3, heads=6, layers=3), {}, "kv_heads: prefill 8 vs decode 6"),
    ],
    ids=["head_dim", "page_size", "kv_heads", "layers", "tp3"],
)
def test_a_decode_rank_that_does_not_match_is_refused_naming_both(
        decode: RankPlace, over: dict[str, Any], message: str) -> None:
    hub = LocalTransferHub()
    managers = [_manager(hub, _place(t, 2, heads=8, layers=3)) for t in range(2)]
    try:
        receiver = LocalDecodeManager(_pool(decode, KVLayout.LAYER_MAJOR, 1, **over),
                                      MetadataBuffers(2), hub=hub,
                                      place=decode).create_receiver(ADDR, 1)
        with pytest.raises(KVGeometryError, match=message):
            receiver.init()
    finally:
        for m in managers:
            m.close()


def test_a_server_missing_ranks_fails_the_receiver(closing: list[Pair]) -> None:
    hub = LocalTransferHub()
    only = _manager(hub, _place(0, 2, heads=8, layers=3))
    try:
        decode = LocalDecodeManager(_pool(_place(0, 1, heads=8, layers=3), KVLayout.LAYER_MAJOR,
                                          1), MetadataBuffers(2), hub=hub,
                                    place=_place(0, 1, heads=8, layers=3))
        receiver = decode.create_receiver(ADDR, 5)
        receiver.init()
        assert receiver.poll() == KVPoll.FAILED
        assert "has 1 of 2 ranks" in receiver.failure_exception().reason
    finally:
        only.close()


# -- failures on one rank fail the room everywhere ----------------------------------------------


def _paired(pair: Pair, room: int) -> tuple[list[LocalKVSender], list[LocalKVReceiver]]:
    senders = [m.create_sender(ADDR, room) for m in _serving(pair, room)]
    receivers = _receivers(pair, room)
    for m, s in zip(_serving(pair, room), senders, strict=True):
        drive(m, s, {KVPoll.WAITING_FOR_INPUT})
    return senders, receivers


def _clear_all(pair: Pair, ends: list[Any]) -> None:
    for end in ends:
        eventually(end.quiescent, "every end to go quiescent")
        end.clear()
    assert pair.leaks() == []


@pytest.mark.parametrize(("tp", "td", "pp"), [(2, 1, 1), (1, 2, 1), (4, 2, 1), (2, 1, 2)])
def test_an_abort_on_one_prefill_rank_fails_every_rank_and_leaks_nothing(
        closing: list[Pair], tp: int, td: int, pp: int) -> None:
    pair = _pair(tp, td, pp=pp, layers=4)
    closing.append(pair)
    senders, receivers = _paired(pair, 9)
    senders[0].init(len(SRC_PAGES), 0)
    senders[0].send(SRC_PAGES[:2], last=False)
    senders[-1].abort()
    assert senders[-1].failure_exception().reason == REASON_ABORTED
    for s in senders[:-1]:
        assert s.poll() == KVPoll.FAILED
        assert s.failure_exception().reason == REASON_OTHER_RANK
    for r in receivers:
        assert r.poll() == KVPoll.FAILED
        assert r.failure_exception().reason == REASON_PEER_ABORTED
    _clear_all(pair, [*senders, *receivers])
    _run(pair, 9)  # the room is free again


def test_an_abort_on_one_decode_rank_fails_every_rank(closing: list[Pair]) -> None:
    pair = _pair(1, 2)
    closing.append(pair)
    senders, receivers = _paired(pair, 3)
    receivers[1].abort()
    assert senders[0].failure_exception().reason == REASON_PEER_ABORTED
    assert receivers[0].failure_exception().reason == REASON_OTHER_RANK
    _clear_all(pair, [*senders, *receivers])


def test_a_refused_destination_on_one_prefill_rank_fails_every_rank(closing: list[Pair]) -> None:
    pair = _pair(2, 1)
    closing.append(pair)
    live = pair.prefill[0].create_sender(ADDR, 4)
    pair.prefill[1].refuse(4, "prompt_too_long")  # rank 1 never creates its sender
    (receiver,) = _receivers(pair, 4)
    for end in (live, receiver):
        assert end.poll() == KVPoll.FAILED
        assert end.failure_exception().reason == "peer refused: prompt_too_long"
    _clear_all(pair, [live, receiver])


class _BrokenPool(KVPool):
    """A decode pool whose copies raise: a lost device."""

    def by_layer(self) -> torch.Tensor:
        raise RuntimeError("device lost")


def test_a_copy_error_on_one_decode_rank_fails_every_rank(closing: list[Pair]) -> None:
    pair = _pair(1, 2)
    closing.append(pair)
    broken = pair.decode[1]
    place = broken.place
    broken.pool = _BrokenPool(num_layers=3, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                              kv_heads=place.heads_per_rank, head_dim=HEAD_DIM,
                              dtype=torch.bfloat16, model="m")
    senders, receivers = _paired(pair, 6)
    senders[0].init(2, 0)
    senders[0].send([1, 2], last=True)
    assert drive(pair.prefill[0], senders[0], _TERMINAL)[-1] == KVPoll.FAILED
    for end in (*senders, *receivers):
        assert "device lost" in end.failure_exception().reason
    _clear_all(pair, [*senders, *receivers])


def test_a_late_abort_from_an_old_receiver_spares_the_next_use_of_the_room(
        closing: list[Pair]) -> None:
    pair = _pair(2, 2)
    closing.append(pair)
    senders, receivers = _transfer(pair, 8)
    for s in senders:
        s.clear()
    _run(pair, 8)  # old receivers still live: the room's next use pairs with new ones
    for r in receivers:
        r.abort()
        r.clear()
    assert pair.leaks() == []
