"""Hybrid state over the Mooncake backend (both sides in this process, each with its own
transfer engine, over loopback TCP): a chunked request's full pages, draft pages, last SWA
window, recurrent slot and index pages land byte-exact in the decode side's pools and nothing
else there changes; state pools that disagree, or that a decode rank's layout cannot hold, are
refused naming both sides' values; a request aborted while its state is being written gives back
every page and slot once the engine is done, on both sides."""

from __future__ import annotations

import threading
from random import Random

import numpy as np
import pytest
import torch
import zmq

from kv import wire
from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.mooncake import MooncakeKVManager, MooncakeKVSender
from kv.mooncake_decode import MooncakeDecodeManager, MooncakeKVReceiver
from kv.mooncake_state import item_blocks
from kv.pages import Run, pages_needed
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.state_pools import StateKind, StatePools
from kv.state_sends import window_span
from kv.state_shapes import StateShape
from kv.transfer import KVPoll, TransferUsageError
from kv.wire_state import PoolMemory
from lifecycle import FailureReason, PrefillState
from scheduler.messages import NewRequest, Response
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.testing.fakes import PageEchoRunner
from tests.state_harness import (
    PS,
    TERMINAL,
    decode_the_colocated_tokens,
    kv_pool,
    land_across_a_chunk_boundary,
    land_case,
    post_destination,
    state_pools,
)
from tests.transfer_harness import drive, eventually

pytestmark = [pytest.mark.mooncake]


class _Pair:
    """A prefill rank and a decode rank with their own engines behind one bootstrap endpoint;
    ``decode_place`` puts the decode rank in a TP group (its pool holds its heads only)."""

    def __init__(self, prefill: StatePools, decode: StatePools | None,
                 decode_place: RankPlace | None = None, slots: int = 2) -> None:
        self.server = BootstrapServer()
        self.addr = self.server.address
        self.prefill_meta, self.decode_meta = MetadataBuffers(slots), MetadataBuffers(slots)
        self.prefill = MooncakeKVManager(prefill.full, self.prefill_meta, states=prefill)
        try:
            self.prefill.register_to_bootstrap(self.addr)
            pool = decode.full if decode is not None else kv_pool(prefill.full.num_pages,
                                                                 prefill.full.layout)
            self.decode = MooncakeDecodeManager(pool, self.decode_meta, self.addr,
                                                states=decode, place=decode_place)
        except BaseException:
            self.prefill.close()
            self.server.close()
            raise

    def receiver(self, room: int) -> MooncakeKVReceiver:
        return self.decode.create_receiver(self.addr, room)

    def sender(self, room: int) -> MooncakeKVSender:
        return self.prefill.create_sender(self.addr, room)

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.server.close()


@pytest.mark.parametrize("layout", list(KVLayout))
def test_a_chunked_request_lands_every_pool_byte_exact(layout: KVLayout) -> None:
    land_across_a_chunk_boundary(_Pair, layout)


@pytest.mark.parametrize(("length", "progress", "page_size", "window", "layout"), [
    (13, [4, 8, 13], 4, 3, KVLayout.LAYER_MAJOR),  # window inside the last, partial page
    (21, [6, 12, 21], 3, 10, KVLayout.PAGE_MAJOR),  # the window spans two chunk boundaries
    (7, [7], 1, 50, KVLayout.LAYER_MAJOR),  # one chunk, a window longer than the prompt
])
def test_other_chunkings_and_windows_land_every_pool_byte_exact(
        length: int, progress: list[int], page_size: int, window: int,
        layout: KVLayout) -> None:
    land_case(_Pair, page_size, length, progress, window, layout, Random(length))


def test_a_hybrid_prefill_over_mooncake_decodes_the_colocated_tokens() -> None:
    decode_the_colocated_tokens(lambda src, dst: _Pair(src, dst, slots=4))


def test_a_draft_pool_alone_goes_with_every_chunk() -> None:
    # Only a draft model beside the full pool: no state items, the draft's copies of the pages
    # go with each chunk's pages.
    layout = KVLayout.LAYER_MAJOR
    src = StatePools(kv_pool(8, layout), draft=kv_pool(8, layout, 1))
    dst = StatePools(kv_pool(8, layout), draft=kv_pool(8, layout, 1))
    assert src.draft is not None and dst.draft is not None
    for pool in (src.full, src.draft):
        pool.buffer.copy_(torch.randint(1, 99, pool.buffer.shape))
    before = dst.draft.buffer.clone()
    pair = _Pair(src, dst)
    try:
        receiver = pair.receiver(2)
        receiver.init()
        receiver.send_metadata([6, 7, 0], 0)
        sender = pair.sender(2)
        drive(pair.prefill, sender, {KVPoll.WAITING_FOR_INPUT})
        sender.init(3, 1)
        pair.prefill_meta.write(1, first_token=5, cached_tokens=0, logprob=None, room=2)
        sender.send([1, 2], last=False)
        sender.send([5], last=True)
        assert drive(pair.prefill, sender, TERMINAL)[-1] == KVPoll.SUCCESS
        eventually(lambda: receiver.poll() == KVPoll.SUCCESS, "the receiver to conclude")
    finally:
        pair.close()
    got, want = dst.draft.page_view(), src.draft.page_view()
    assert torch.equal(got[:, [6, 7, 0]], want[:, [1, 2, 5]])
    assert torch.equal(got[:, 1:6], before.view(got.shape)[:, 1:6])
    assert torch.equal(dst.full.page_view()[:, [6, 7, 0]], src.full.page_view()[:, [1, 2, 5]])


def test_state_items_go_as_one_block_per_region_and_run() -> None:
    shape = StateShape(regions=2, items=8, item_len=16, dtype="int64")
    src = PoolMemory("recurrent", shape, (1000, 5000))
    dst = PoolMemory("recurrent", shape, (90000, 70000))
    src_at, dst_at, lens = item_blocks(src, dst, [Run(0, 5, 2), Run(4, 1, 1)])
    assert src_at.tolist() == [1000, 1064, 5000, 5064]
    assert dst_at.tolist() == [90080, 90016, 70080, 70016]
    assert lens.tolist() == [32, 16, 32, 16]


def _refused(pair: _Pair, room: int, why: str, *, sender_first: bool) -> None:
    """The room fails on both sides with ``why``, whichever side came first; nothing of it is
    left once both cleared."""
    sender = pair.sender(room) if sender_first else None
    receiver = pair.receiver(room)
    receiver.init()
    receiver.send_metadata([0, 1], 0, state={StateKind.RECURRENT: [0]}
                           if pair.decode.states is not None else None)
    eventually(lambda: receiver.poll() == KVPoll.FAILED, "the decode side to fail the room")
    assert why in str(receiver.failure_exception())
    assert receiver.failure_exception().refused
    sender = sender or pair.sender(room)
    assert drive(pair.prefill, sender, TERMINAL)[-1] == KVPoll.FAILED
    assert why in str(sender.failure_exception())
    eventually(receiver.quiescent, "the decode room to be quiescent")
    assert sender.quiescent()
    sender.clear()
    receiver.clear()
    assert pair.prefill.live_rooms() == pair.decode.live_rooms() == 0


@pytest.mark.parametrize("sender_first", [True, False])
def test_state_pools_that_disagree_are_refused_naming_both_sides(sender_first: bool) -> None:
    layout = KVLayout.PAGE_MAJOR
    cases = [
        (state_pools(12, 9, 3, layout, window=5), "swa window: 9 vs 5"),
        (None, "swa: 1 regions of 192-byte float32 items, page_major vs none"),
        (state_pools(12, 9, 3, KVLayout.LAYER_MAJOR, full=kv_pool(12, layout)),
         "draft: 1 regions of 192-byte float32 items, page_major vs 2 regions of 96-byte "
         "float32 items, layer_major"),
    ]
    for room, (decode, why) in enumerate(cases, start=1):
        pair = _Pair(state_pools(12, 9, 3, layout), decode)
        try:
            _refused(pair, room, why, sender_first=sender_first)
            assert pair.prefill.dropped_messages.total == 0
        finally:
            pair.close()


def test_state_pools_a_decode_layout_cannot_hold_are_refused() -> None:
    # A decode rank at TP 2 holds one head of the draft and SWA pools and half the recurrent
    # channels; these pools are whole (and five channels do not split in two).
    layout = KVLayout.LAYER_MAJOR
    decode_place = RankPlace(tp_rank=0, tp_size=2, kv_heads=2, num_layers=2, layer_start=0,
                             layer_stop=2)
    one_head = KVPool(num_layers=2, num_pages=12, page_size=PS, kv_heads=1, head_dim=3,
                      layout=layout)
    pair = _Pair(state_pools(12, 9, 3, layout), state_pools(12, 9, 3, layout, full=one_head),
                 decode_place)
    try:
        _refused(pair, 5, "draft: 2 regions of 48-byte float32 items, layer_major vs 2 regions "
                          "of 96-byte float32 items, layer_major", sender_first=False)
    finally:
        pair.close()


def test_an_abort_while_the_state_is_written_leaks_nothing_on_either_side(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The prefill engine's completion of the one write (pages, draft pages, state, metadata
    # row) is held: the request is aborted while that write is in flight.
    layout = KVLayout.PAGE_MAJOR
    src, dst = state_pools(12, 9, 2, layout), state_pools(12, 9, 2, layout)
    pair = _Pair(src, dst)
    engine = pair.prefill._control.engine
    wait, submitted, gate = engine.wait, threading.Event(), threading.Event()

    def held_wait(batch: int) -> int:
        submitted.set()
        assert gate.wait(timeout=60), "the test never released the write"
        return wait(batch)

    monkeypatch.setattr(engine, "wait", held_wait)
    responses: list[Response] = []
    slots = SlotAllocator(2)
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=PS, chunked_prefill_size=16, check_invariants=True),
        runner=PageEchoRunner(src.full), kv=pair.prefill, metadata=pair.prefill_meta,
        slots=slots, on_response=responses.append, states=src)
    assert dst.swa is not None and dst.recurrent is not None
    length = 14
    window = window_span(length, 9, PS)
    dst_pages = dst.full.allocator.alloc(pages_needed(length, PS))
    dst_swa = dst.swa.pool.allocator.alloc(len(window))
    dst_slot = dst.recurrent.allocator.alloc()
    assert dst_pages is not None and dst_swa is not None and dst_slot is not None
    try:
        receiver = pair.receiver(3)
        receiver.init()
        post_destination(receiver, dst_pages, 1, dst_swa, dst_slot)
        sched.submit(NewRequest("a", tuple(range(length)), bootstrap_host="127.0.0.1",
                                bootstrap_port=1, bootstrap_room=3))
        sched.run_until(submitted.is_set, timeout=30)
        req = sched.lifecycle.get("a")
        assert req is not None and req.state is PrefillState.TRANSFERRING
        slot, pages = req.state_slot, list(req.pages)
        assert slot is not None and src.swa is not None and src.recurrent is not None
        swa = src.swa.translate(pages)
        sched.abort("a")
        sched.run_until(lambda: bool(responses), timeout=30)
        assert [(r.state, r.reason) for r in responses] == [
            (PrefillState.FAILED, FailureReason.ABORTED)]
        for _ in range(3):  # held while the engine may still read them, on both sides
            sched.step()
            assert not src.recurrent.allocator.is_free(slot)
            assert set(swa) <= set(src.swa.pool.allocator.held_pages())
            assert set(pages) <= set(src.full.allocator.held_pages())
            assert not receiver.quiescent() and receiver.poll() != KVPoll.SUCCESS
        gate.set()
        sched.run_until(sched.idle, timeout=30)
        assert src.all_free() and src.full.allocator.available() == src.full.num_pages
        assert slots.available() == 2 and pair.prefill.live_rooms() == 0
        eventually(receiver.quiescent, "the decode side to learn the room is quiescent")
        assert receiver.poll() == KVPoll.FAILED
        assert "aborted" in str(receiver.failure_exception())
        receiver.clear()
        assert pair.decode.live_rooms() == 0
    finally:
        gate.set()
        sched.close()
        pair.close()


def test_a_destination_names_only_registered_state_items() -> None:
    layout = KVLayout.PAGE_MAJOR
    pair = _Pair(state_pools(12, 9, 3, layout), state_pools(12, 9, 3, layout))
    try:
        receiver = pair.receiver(4)
        receiver.init()
        with pytest.raises(TransferUsageError, match="recurrent item 3 is not in the decode"):
            receiver.send_metadata([0], 0, state={StateKind.RECURRENT: [3]})
        # A destination naming items past the registered pool (from a peer that does not
        # check) is dropped and counted; sent once the prefill took the decode's Register (it
        # comes on another connection, so it could otherwise arrive first: unknown_session).
        eventually(lambda: pair.decode.session in pair.prefill.decode_sessions(),
                   "the decode's registration")
        bad = wire.Destination(4, pair.decode.session, np.array([0]), 0,
                               state={"recurrent": np.array([3])})
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(pair.prefill.endpoint)
            sock.send(wire.encode(bad))
        eventually(lambda: pair.prefill.dropped_messages.snapshot().get(
            "state_out_of_range", 0) == 1, "the destination to be dropped")
        receiver.abort()
    finally:
        pair.close()


def test_a_last_chunk_whose_state_does_not_fit_the_destination_fails_both_sides() -> None:
    layout = KVLayout.PAGE_MAJOR
    src = state_pools(12, 9, 3, layout)
    pair = _Pair(src, state_pools(12, 9, 3, layout))
    try:
        receiver = pair.receiver(6)
        receiver.init()
        receiver.send_metadata([0, 1], 0, state={StateKind.RECURRENT: [2]})  # no window
        sender = pair.sender(6)
        drive(pair.prefill, sender, {KVPoll.WAITING_FOR_INPUT})
        sender.init(2, 0)
        sender.send([3], last=False)
        sender.send_state({StateKind.SWA: [4], StateKind.RECURRENT: [0]})
        sender.send([4], last=True)
        assert drive(pair.prefill, sender, TERMINAL)[-1] == KVPoll.FAILED
        why = "state kinds differ: ['recurrent', 'swa'] sent, ['recurrent'] received"
        assert why in str(sender.failure_exception())
        eventually(lambda: receiver.poll() == KVPoll.FAILED, "the decode side to fail")
        assert why in str(receiver.failure_exception())
        eventually(receiver.quiescent, "the decode room to be quiescent")
    finally:
        pair.close()
