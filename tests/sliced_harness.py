"""Both sides of a PD pair as ranks of different parallel layouts over the local backend, in one
process (one manager per rank): random whole-model KV spread over the prefill ranks, rooms run
through every rank, what landed checked on every decode rank, and leak checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch

from kv.local import LocalKVManager, LocalKVSender, LocalTransferHub
from kv.local_decode import LocalDecodeManager, LocalKVReceiver
from kv.metadata import MetadataBuffers
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.transfer import KVPoll
from tests.transfer_harness import drive, eventually

ADDR = "local:sliced"
PAGE_SIZE, HEAD_DIM, NUM_PAGES = 2, 4, 24
TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}
SRC_PAGES = [3, 4, 5, 9, 10, 20]


def rank_place(tp: int, tp_size: int, *, heads: int, layers: int, pp: int = 0, pp_size: int = 1,
           dp: int = 0, dp_size: int = 1, mla: bool = False) -> RankPlace:
    return RankPlace(tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, dp_rank=dp,
                     dp_size=dp_size, kv_heads=heads, mla=mla, num_layers=layers,
                     layer_start=pp * layers // pp_size, layer_stop=(pp + 1) * layers // pp_size)


def make_pool(place: RankPlace, layout: KVLayout, seed: int, **over: Any) -> KVPool:
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


def closing_pairs() -> Iterator[list[Pair]]:
    """A fixture's body: the pairs a test makes, closed after it."""
    pairs: list[Pair] = []
    yield pairs
    for p in pairs:
        p.close()


def make_pair(tp: int, td: int, *, heads: int = 8, layers: int = 3, pp: int = 1, dp: int = 1,
          mla: bool = False, layout: KVLayout = KVLayout.LAYER_MAJOR) -> Pair:
    hub = LocalTransferHub()
    model_kv = torch.randn((layers, 2, len(SRC_PAGES), PAGE_SIZE, heads, HEAD_DIM),
                           generator=torch.Generator().manual_seed(tp * 100 + td)
                           ).to(torch.bfloat16)
    prefill = []
    for d in range(dp):
        for s in range(pp):
            for t in range(tp):
                place = rank_place(t, tp, heads=heads, layers=layers, pp=s, pp_size=pp, dp=d,
                               dp_size=dp, mla=mla)
                pool = make_pool(place, layout, seed=place.rank)
                held = place.tp_layout.heads_of(t)
                pool.by_layer()[:, :, SRC_PAGES] = model_kv[
                    place.layer_start : place.layer_stop, :, :, :, held.start : held.stop]
                prefill.append(LocalKVManager(pool, MetadataBuffers(4), hub=hub,
                                              bootstrap_addr=ADDR, place=place))
    decode = []
    for t in range(td):
        place = rank_place(t, td, heads=heads, layers=layers, mla=mla)
        decode.append(LocalDecodeManager(make_pool(place, layout, seed=100 + t), MetadataBuffers(4),
                                         hub=hub, place=place))
    return Pair(hub, prefill, decode, model_kv)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def dst_pages(d: int) -> list[int]:
    """Each decode rank's destination: other pages than its neighbours', in other runs."""
    return [(7 * d + 2 * i + 1) % NUM_PAGES for i in range(len(SRC_PAGES))]


def make_receivers(pair: Pair, room: int) -> list[LocalKVReceiver]:
    out = []
    for d, manager in enumerate(pair.decode):
        receiver = manager.create_receiver(ADDR, room)
        receiver.init()
        receiver.send_metadata(dst_pages(d), slot=d % 4)
        out.append(receiver)
    return out


def serving_ranks(pair: Pair, room: int) -> list[LocalKVManager]:
    """The prefill ranks of the DP replica that serves ``room``."""
    return [m for m in pair.prefill if m.place.dp_rank == room % m.place.dp_size]


def transfer(pair: Pair, room: int, *, decode_first: bool = False,
             ) -> tuple[list[LocalKVSender], list[LocalKVReceiver]]:
    """Run ``room`` through every rank: every sender created and paired before any sends, as
    the prefill TP ranks' agreement makes the scheduler do; the decode ranks' destinations
    before or after the senders exist."""
    serving = serving_ranks(pair, room)
    receivers = make_receivers(pair, room) if decode_first else []
    senders = [m.create_sender(ADDR, room) for m in serving]
    receivers = receivers or make_receivers(pair, room)
    for m, s in zip(serving, senders, strict=True):
        assert drive(m, s, {KVPoll.WAITING_FOR_INPUT}) == [KVPoll.WAITING_FOR_INPUT]
        s.init(len(SRC_PAGES), 2)
        m.metadata.write(2, first_token=42, cached_tokens=1, logprob=None, room=room)
        s.send(SRC_PAGES[:4], last=False)
        s.send(SRC_PAGES[4:], last=True)
    for m, s in zip(serving, senders, strict=True):
        assert drive(m, s, TERMINAL)[-1] == KVPoll.SUCCESS
    for r in receivers:
        eventually(lambda r=r: r.poll().terminal, "a receiver to conclude")  # type: ignore[misc]
    return senders, receivers


def check_landed(pair: Pair, room: int, before: list[torch.Tensor]) -> None:
    kv = pair.model_kv
    for d, manager in enumerate(pair.decode):
        held = manager.place.tp_layout.heads_of(d)
        landed = manager.pool.by_layer()
        pages = dst_pages(d)
        assert torch.equal(bits(landed[:, :, pages]),
                           bits(kv[:, :, :, :, held.start : held.stop])), f"decode rank {d}"
        others = [p for p in range(NUM_PAGES) if p not in pages]
        assert torch.equal(bits(landed[:, :, others]), bits(before[d][:, :, others]))
        row = manager.metadata.read(d % 4, expected_room=room)
        assert row is not None and row.first_token == 42


def run_room(pair: Pair, room: int = 77, *, decode_first: bool = False,
             ) -> tuple[list[LocalKVSender], list[LocalKVReceiver]]:
    before = [m.pool.by_layer().clone() for m in pair.decode]
    senders, receivers = transfer(pair, room, decode_first=decode_first)
    assert [r.poll() for r in receivers] == [KVPoll.SUCCESS] * len(receivers)
    check_landed(pair, room, before)
    for end in [*senders, *receivers]:
        assert end.quiescent()
        end.clear()
    assert pair.leaks() == []
    return senders, receivers


def paired(pair: Pair, room: int) -> tuple[list[LocalKVSender], list[LocalKVReceiver]]:
    senders = [m.create_sender(ADDR, room) for m in serving_ranks(pair, room)]
    receivers = make_receivers(pair, room)
    for m, s in zip(serving_ranks(pair, room), senders, strict=True):
        drive(m, s, {KVPoll.WAITING_FOR_INPUT})
    return senders, receivers


def clear_all(pair: Pair, ends: list[Any]) -> None:
    for end in ends:
        eventually(end.quiescent, "every end to go quiescent")
        end.clear()
    assert pair.leaks() == []
