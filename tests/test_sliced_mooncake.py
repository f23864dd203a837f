"""The Mooncake backend between prefill and decode servers of different parallel layouts: head
slices for different TP sizes, MLA's status-only ranks, prefill pipeline stages and DP
replicas.

Every rank of both servers runs in this process with its own transfer engine, over loopback TCP
(an engine starts in a fraction of a second, so each case builds its own servers). Each prefill
rank's pool holds its heads of its stage's layers of one random whole-model KV; after the
transfer every decode rank's pages must hold exactly its heads of every layer, byte for byte,
nothing else in its pool may change, and its metadata row must carry the room.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import pytest
import torch

from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager, MooncakeKVSender
from kv.mooncake_decode import MooncakeDecodeManager, MooncakeKVReceiver
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.transfer import KVPoll
from tests.transfer_harness import drive, eventually

pytestmark = [pytest.mark.mooncake]

LAYERS, PAGE_SIZE, HEAD_DIM, PAGES, SLOTS = 3, 4, 8, 24, 4
SRC_PAGES = [3, 4, 5, 9, 10, 20]
DST_PAGES = [7, 8, 0, 1, 2, 15]
_DONE = {KVPoll.SUCCESS, KVPoll.FAILED}


@attrs.frozen
class Layout:
    prefill_tp: int
    decode_tp: int
    heads: int = 8
    mla: bool = False
    prefill_pp: int = 1
    prefill_dp: int = 1
    kv_layout: KVLayout = KVLayout.PAGE_MAJOR


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _stage_layers(pp: int, stage: int) -> range:
    """Stage ``stage`` of ``pp``: later stages take the extra layer (as the sharded model)."""
    base, extra = divmod(LAYERS, pp)
    start = stage * base + max(0, stage - (pp - extra))
    return range(start, start + base + (stage >= pp - extra))


@attrs.define
class Servers:
    """A prefill server (every stage's TP ranks behind one bootstrap endpoint) and a decode
    server, in one process."""

    layout: Layout
    model_kv: torch.Tensor
    server: BootstrapServer
    prefill: list[MooncakeKVManager]
    decode: list[MooncakeDecodeManager]
    before: list[torch.Tensor]

    def serving(self, room: int) -> list[MooncakeKVManager]:
        """The prefill ranks of the DP replica that serves ``room`` (room mod the DP size)."""
        return [m for m in self.prefill if m.place.dp_rank == room % self.layout.prefill_dp]


@contextmanager
def servers(layout: Layout, seed: int = 0,
            decode_tps: tuple[int, ...] | None = None) -> Iterator[list[Servers]]:
    """One prefill server, and a decode server for each of ``decode_tps`` (``layout``'s decode
    TP size by default) registered with it: prefill ranks serve decode servers of different
    TP sizes at once, each decode rank's registration carrying its own layout."""
    gen = torch.Generator().manual_seed(seed)
    model_kv = torch.randn((LAYERS, 2, len(SRC_PAGES), PAGE_SIZE, layout.heads, HEAD_DIM),
                           generator=gen)
    tp, pp, dp = layout.prefill_tp, layout.prefill_pp, layout.prefill_dp
    server = BootstrapServer(expected_ranks=tp * pp * dp)
    prefill: list[MooncakeKVManager] = []
    decodes: list[list[MooncakeDecodeManager]] = []
    try:
        for replica, stage, t in itertools.product(range(dp), range(pp), range(tp)):
            layers = _stage_layers(pp, stage)
            place = RankPlace(tp_rank=t, tp_size=tp, pp_rank=stage, pp_size=pp,
                              dp_rank=replica, dp_size=dp, kv_heads=layout.heads,
                              mla=layout.mla, num_layers=LAYERS, layer_start=layers.start,
                              layer_stop=layers.stop)
            pool = _pool(place.heads_per_rank, len(layers), layout.kv_layout, gen)
            held = place.tp_layout.heads_of(t)
            pool.by_layer()[:, :, SRC_PAGES] = model_kv[
                layers.start : layers.stop, :, :, :, held.start : held.stop]
            manager = MooncakeKVManager(pool, MetadataBuffers(SLOTS), place=place)
            prefill.append(manager)
            manager.register_to_bootstrap(server.address)
            server.add_refusal_listener(manager.peer_refused)
        for td in decode_tps or (layout.decode_tp,):
            decode: list[MooncakeDecodeManager] = []
            decodes.append(decode)
            for d in range(td):
                place = RankPlace(tp_rank=d, tp_size=td, kv_heads=layout.heads,
                                  mla=layout.mla, num_layers=LAYERS, layer_start=0,
                                  layer_stop=LAYERS)
                pool = _pool(place.heads_per_rank, LAYERS, layout.kv_layout, gen)
                decode.append(MooncakeDecodeManager(pool, MetadataBuffers(SLOTS),
                                                    server.address, place=place))
        yield [Servers(attrs.evolve(layout, decode_tp=len(decode)), model_kv, server, prefill,
                       decode, [m.pool.by_layer().clone() for m in decode])
               for decode in decodes]
    finally:
        for m in (m for decode in decodes for m in decode):
            m.close()
        for p in prefill:
            p.close()
        server.close()


def _pool(heads: int, layers: int, kv_layout: KVLayout, gen: torch.Generator) -> KVPool:
    pool = KVPool(num_layers=layers, num_pages=PAGES, page_size=PAGE_SIZE, kv_heads=heads,
                  head_dim=HEAD_DIM, model="sliced", layout=kv_layout)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    return pool


def _start(s: Servers, room: int, slot: int = 1
           ) -> tuple[list[MooncakeKVSender], list[MooncakeKVReceiver]]:
    """Every decode rank posts its destination; every prefill rank bootstraps the room, writes
    the same metadata row and sends the first of two chunks."""
    receivers = []
    for m in s.decode:
        rx = m.create_receiver(s.server.address, room)
        rx.init()
        rx.send_metadata(DST_PAGES, slot)
        receivers.append(rx)
    senders = []
    for m in s.serving(room):
        tx = m.create_sender(s.server.address, room)
        assert drive(m, tx, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
        tx.init(len(SRC_PAGES), slot)
        m.metadata.write(slot, first_token=42, cached_tokens=0, logprob=-0.5, room=room)
        tx.send(SRC_PAGES[:3], last=False)
        senders.append(tx)
    return senders, receivers


def _finish(s: Servers, senders: list[MooncakeKVSender],
            receivers: list[MooncakeKVReceiver]) -> tuple[list[KVPoll], list[KVPoll]]:
    """Drive every room to its end; the ends, then clear every room once it is quiescent."""
    prefill = s.serving(receivers[0].room)
    sent = [drive(m, tx, _DONE)[-1] for m, tx in zip(prefill, senders, strict=True)]
    got = [drive(m, rx, _DONE)[-1] for m, rx in zip(s.decode, receivers, strict=True)]
    for m, end in ((prefill, senders), (s.decode, receivers)):
        for manager, one in zip(m, end, strict=True):
            drive(manager, _Quiet(one), {KVPoll.SUCCESS})
            one.clear()
    return sent, got


@attrs.frozen
class _Quiet:
    """Polls SUCCESS once ``end`` is quiescent (so :func:`drive` can wait for it)."""

    end: MooncakeKVSender | MooncakeKVReceiver

    @property
    def room(self) -> int:
        return self.end.room

    def poll(self) -> KVPoll:
        return KVPoll.SUCCESS if self.end.quiescent() else KVPoll.TRANSFERRING


def _check_landed(s: Servers, room: int, slot: int = 1) -> None:
    others = [p for p in range(PAGES) if p not in DST_PAGES]
    for d, m in enumerate(s.decode):
        held = m.place.tp_layout.heads_of(d)
        landed = m.pool.by_layer()
        want = s.model_kv[:, :, :, :, held.start : held.stop]
        assert torch.equal(_bits(landed[:, :, DST_PAGES]), _bits(want)), f"decode rank {d}"
        assert torch.equal(_bits(landed[:, :, others]), _bits(s.before[d][:, :, others]))
        row = m.metadata.read(slot, expected_room=room)
        assert row is not None and row.first_token == 42, f"decode rank {d}: {row}"


PREFILLS = [
    # Prefill TP {1, 2, 4}, each serving decode servers at TP 1, 2 and 4 at once.
    *((Layout(tp, 1), (1, 2, 4)) for tp in (1, 2, 4)),
    (Layout(4, 1, heads=2), (1, 2)),  # GQA: two KV heads, each on two prefill ranks
    (Layout(4, 1, heads=1, mla=True), (2, 4)),  # MLA: status-only ranks at TP 4 -> 2
    (Layout(1, 1, heads=1, mla=True), (2,)),
    (Layout(1, 1, prefill_pp=2), (1,)),
    (Layout(2, 1, prefill_pp=2, kv_layout=KVLayout.LAYER_MAJOR), (1, 2)),
    (Layout(2, 1, kv_layout=KVLayout.LAYER_MAJOR), (4,)),
    (Layout(2, 1, prefill_dp=2), (1, 2)),  # two DP replicas behind one bootstrap endpoint
]


@pytest.mark.parametrize(("layout", "decode_tps"), PREFILLS, ids=lambda x: (
    f"tp{x.prefill_tp}-pp{x.prefill_pp}-dp{x.prefill_dp}-h{x.heads}{'-mla' if x.mla else ''}"
    f"-{x.kv_layout.value}"
    if isinstance(x, Layout) else "to-tp" + "-".join(map(str, x))))
def test_random_kv_lands_byte_exact_on_every_decode_rank(
    layout: Layout, decode_tps: tuple[int, ...]
) -> None:
    with servers(layout, decode_tps=decode_tps) as pairs:
        for i, s in enumerate(pairs):
            for replica in range(layout.prefill_dp):  # a room served by each DP replica
                room = (1 << 63) + 8 * i + replica
                for m, before in zip(s.decode, s.before, strict=True):
                    m.pool.by_layer().copy_(before)  # so the next room's bytes must land again
                senders, receivers = _start(s, room)
                for tx in senders:
                    tx.send(SRC_PAGES[3:], last=True)
                sent, got = _finish(s, senders, receivers)
                assert sent == [KVPoll.SUCCESS] * len(senders), s.layout
                assert got == [KVPoll.SUCCESS] * len(receivers), s.layout
                _check_landed(s, room)
                _check_nothing_left(s)


def _check_nothing_left(s: Servers) -> None:
    assert [m.live_rooms() for m in s.prefill] == [0] * len(s.prefill)
    assert [m.live_rooms() for m in s.decode] == [0] * len(s.decode)


@pytest.mark.parametrize(("layout", "aborts", "connected"), [
    # One of the decode rank's two sources aborts: the decode rank fails and aborts the other.
    (Layout(2, 1), ("prefill", 1), (2, 1)),
    # One of the prefill rank's two decode ranks aborts: the prefill rank fails both.
    (Layout(1, 2), ("decode", 1), (1, 2)),
    # The last stage aborts: decode fails and aborts stage 0.
    (Layout(1, 1, prefill_pp=2), ("prefill", 1), (2, 1)),
    # A status-only MLA rank aborts: it tells decode rank 0, which aborts prefill rank 0; decode
    # rank 1 and its prefill ranks 2 and 3 learn it from their TP groups' MIN poll.
    (Layout(4, 2, heads=1, mla=True), ("prefill", 1), (2, 1)),
], ids=["tp2-to-tp1", "tp1-to-tp2", "pp2-to-pp1", "mla-status-only"])
def test_a_failure_on_one_rank_fails_the_room_everywhere(
    layout: Layout, aborts: tuple[str, int], connected: tuple[int, int]
) -> None:
    """``connected``: how many prefill senders and decode receivers (the first ones) the
    transfer layer fails by itself; the scheduler's MIN poll over each TP group fails the room
    on the others, which the test plays by aborting the senders left."""
    room = 77
    with servers(layout, seed=1) as (s,):
        senders, receivers = _start(s, room)
        side, index = aborts
        (receivers if side == "decode" else senders)[index].abort()
        for m, tx in zip(s.prefill[: connected[0]], senders, strict=False):
            assert drive(m, tx, _DONE)[-1] == KVPoll.FAILED
        for m, rx in zip(s.decode[: connected[1]], receivers, strict=False):
            assert drive(m, rx, _DONE)[-1] == KVPoll.FAILED
        left = senders[connected[0] :]
        for tx in left:
            # Not connected to the failure (the message says what failed it otherwise, and
            # which decode rank's session is which). Every one is checked before any is
            # aborted: aborting one fails the others of its decode rank's contacts through
            # that decode rank (it aborts every contact that may still hold the room), so a
            # check after an abort races that.
            assert tx.poll() != KVPoll.FAILED, (tx.failure_exception(),
                                                [m.session for m in s.decode])
        for tx in left:
            tx.abort()  # the prefill TP group's MIN poll
        for tx in senders:
            tx.send(SRC_PAGES[3:], last=True)
        sent, got = _finish(s, senders, receivers)
        assert sent == [KVPoll.FAILED] * len(senders)
        assert got == [KVPoll.FAILED] * len(receivers)
        _check_nothing_left(s)
        # The servers still serve the next room, every byte of it.
        senders, receivers = _start(s, room + 1, slot=2)
        for tx in senders:
            tx.send(SRC_PAGES[3:], last=True)
        assert _finish(s, senders, receivers) == (
            [KVPoll.SUCCESS] * len(senders), [KVPoll.SUCCESS] * len(receivers))
        _check_landed(s, room + 1, slot=2)


def test_a_decode_rank_that_refuses_fails_the_room_on_the_one_that_did_not() -> None:
    """Prefill TP 1 writes into two decode ranks; one gives its destination, the other refuses
    the room (after the prefill sender exists, then before): the prefill room fails, and the
    first decode rank learns it at once."""
    with servers(Layout(1, 2), seed=2) as (s,):
        addr = s.server.address
        for room, sender_first in ((98, True), (99, False)):
            rx = s.decode[0].create_receiver(addr, room)
            rx.init()
            rx.send_metadata(DST_PAGES, 1)
            if sender_first:
                tx = s.prefill[0].create_sender(addr, room)
            s.decode[1].refuse(addr, room, "decode rank 1 is full")
            if not sender_first:
                eventually(lambda room=room: s.prefill[0]._rooms._peer_refused.get(room)
                           is not None, "the refusal reached the prefill rank")
                tx = s.prefill[0].create_sender(addr, room)
            assert drive(s.prefill[0], tx, _DONE)[-1] == KVPoll.FAILED
            assert "decode rank 1 is full" in tx.failure_exception().reason
            assert drive(s.decode[0], rx, _DONE)[-1] == KVPoll.FAILED
            assert "decode rank 1 is full" in rx.failure_exception().reason
            assert tx.quiescent() and rx.quiescent()
            tx.clear()
            rx.clear()
            _check_nothing_left(s)
