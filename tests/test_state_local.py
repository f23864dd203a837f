"""Hybrid state over the local backend: a chunked request's full pages, draft pages, last SWA
window, recurrent slot and index pages land byte-exact in the decode side's pools, and nothing
else there changes; pools that disagree are refused at the handshake."""

from __future__ import annotations

from random import Random

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv.local import LocalKVManager, LocalKVSender, LocalTransferHub
from kv.local_decode import LocalDecodeManager, LocalKVReceiver
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pages import pages_needed
from kv.pool import KVGeometryError
from kv.pool_layout import KVLayout
from kv.state_pools import RecurrentPool, StateKind, StatePools, SWAPool
from kv.state_sends import window_span
from kv.transfer import KVPoll, TransferUsageError
from scheduler.messages import NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch, ForwardItem
from tests.state_harness import (
    PS,
    kv_pool,
    land_across_a_chunk_boundary,
    land_case,
    state_pools,
)
from tests.strategies import chunked_prompts
from tests.transfer_harness import drive

ADDR = "local:state"


class _Pair:
    def __init__(self, prefill: StatePools, decode: StatePools | None) -> None:
        self.addr = ADDR
        self.hub = LocalTransferHub()
        self.prefill_meta, self.decode_meta = MetadataBuffers(2), MetadataBuffers(2)
        self.prefill = LocalKVManager(prefill.full, self.prefill_meta, hub=self.hub,
                                      bootstrap_addr=ADDR, states=prefill)
        pool = decode.full if decode is not None else kv_pool(prefill.full.num_pages,
                                                             prefill.full.layout)
        self.decode = LocalDecodeManager(pool, self.decode_meta, hub=self.hub, states=decode)

    def receiver(self, room: int) -> LocalKVReceiver:
        return self.decode.create_receiver(ADDR, room)

    def sender(self, room: int) -> LocalKVSender:
        return self.prefill.create_sender(ADDR, room)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.mark.parametrize("layout", list(KVLayout))
def test_a_chunked_request_lands_every_pool_byte_exact(layout: KVLayout) -> None:
    land_across_a_chunk_boundary(_Pair, layout)


@given(chunked_prompts(max_len=40), st.integers(min_value=1, max_value=50),
       st.sampled_from(list(KVLayout)), st.randoms(use_true_random=False))
def test_any_chunking_and_window_lands_every_pool_byte_exact(
    case: tuple[int, int, list[int]], window: int, layout: KVLayout, rng: Random,
) -> None:
    page_size, length, progress = case
    land_case(_Pair, page_size, length, progress, window, layout, rng)


def test_state_pools_that_disagree_are_refused_at_the_handshake() -> None:
    layout = KVLayout.PAGE_MAJOR
    cases = [
        (None, "swa: 1 regions of 192-byte float32 items, page_major vs none"),
        (state_pools(12, 9, 3, layout, window=5), "swa window: 9 vs 5"),
    ]
    for decode, why in cases:
        pair = _Pair(state_pools(12, 9, 3, layout), decode)
        try:
            receiver = pair.decode.create_receiver(ADDR, 3)
            with pytest.raises(KVGeometryError, match=why):
                receiver.init()
        finally:
            pair.close()


def test_state_items_outside_a_pool_are_misuse() -> None:
    layout = KVLayout.LAYER_MAJOR
    pair = _Pair(state_pools(12, 9, 3, layout), state_pools(12, 9, 3, layout))
    try:
        receiver = pair.decode.create_receiver(ADDR, 4)
        receiver.init()
        with pytest.raises(TransferUsageError, match="recurrent item 3 is not in the decode"):
            receiver.send_metadata([0], 0, state={StateKind.RECURRENT: [3]})
        receiver.send_metadata([0], 0, state={StateKind.RECURRENT: [2]})
        sender = pair.prefill.create_sender(ADDR, 4)
        drive(pair.prefill, sender, {KVPoll.WAITING_FOR_INPUT})
        sender.init(1, 0)
        with pytest.raises(TransferUsageError, match="swa item 9 is not in the prefill"):
            sender.send_state({StateKind.SWA: [9]})
        sender.abort()
    finally:
        pair.close()


MIXED = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=6), layers=4, swa_layers=(0, 2),
                                sliding_window=6, recurrent_layers=(1,)))


def _model_states(model: LlamaModel, pages: int, swa_pages: int, slots: int) -> StatePools:
    c = model.config
    return StatePools(
        model.make_pool(num_pages=pages, page_size=PS),
        swa=SWAPool(window=c.sliding_window, full_pages=pages,
                    pool=model.make_swa_pool(num_pages=swa_pages, page_size=PS)),
        recurrent=RecurrentPool(model.make_states(slots)))


def test_a_hybrid_prefill_over_the_local_backend_decodes_the_colocated_tokens() -> None:
    # The prefill scheduler computes hybrid prompts in chunks and sends the last window and the
    # recurrent state over the local backend; the decode side's runner then computes the second
    # token from what landed, with only the window's SWA pages: it must be the colocated one.
    model, c = MIXED, MIXED.config
    src, dst = _model_states(model, 24, 20, 2), _model_states(model, 24, 20, 4)
    assert src.swa is not None and src.recurrent is not None
    assert dst.swa is not None and dst.recurrent is not None
    # What did not land reads as NaN (or a wrong state): the second token would not match.
    for pool in (dst.full, dst.swa.pool):
        pool.buffer.fill_(float("nan"))
    dst.recurrent.buffer.fill_(7777)
    hub, responses = LocalTransferHub(), list[Response]()
    prefill = LocalKVManager(src.full, MetadataBuffers(4), hub=hub, bootstrap_addr=ADDR,
                             states=src)
    decode_meta = MetadataBuffers(4)
    decode = LocalDecodeManager(dst.full, decode_meta, hub=hub, states=dst)
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=PS, chunked_prefill_size=8, check_invariants=True),
        runner=PagedModelRunner(model, src.full, swa_pool=src.swa.pool,
                                states=src.recurrent.buffer),
        kv=prefill, metadata=prefill.metadata, slots=SlotAllocator(4),
        on_response=responses.append, states=src)
    prompts = {room: tuple((3 * i + room) % 200 for i in range(n))
               for room, n in ((1, 13), (2, 21), (3, 16))}
    landing = {}
    for room, prompt in prompts.items():
        n = len(prompt)
        window = window_span(n, c.sliding_window, PS)
        pages = dst.full.allocator.alloc(pages_needed(n + 1, PS))
        swa = dst.swa.pool.allocator.alloc(pages_needed(n + 1, PS) - window.start)
        slot = dst.recurrent.allocator.alloc()
        assert pages is not None and swa is not None and slot is not None
        receiver = decode.create_receiver(ADDR, room)
        receiver.init()
        receiver.send_metadata(pages[: pages_needed(n, PS)], room, state={
            StateKind.SWA: swa[: len(window)], StateKind.RECURRENT: [slot]})
        landing[room] = (receiver, pages, [-1] * window.start + swa, slot)
        sched.submit(NewRequest(f"r{room}", prompt, bootstrap_host="decode", bootstrap_port=1,
                                bootstrap_room=room))
    try:
        sched.run_until(lambda: len(responses) == len(prompts), timeout=60)
        sched.run_until(sched.idle, timeout=60)
    finally:
        sched.close()
        prefill.close()
    runner = PagedModelRunner(model, dst.full, swa_pool=dst.swa.pool, states=dst.recurrent.buffer)
    reference = ReferenceModel(model)
    assert src.all_free()
    for room, prompt in prompts.items():
        receiver, pages, swa, slot = landing[room]
        assert receiver.poll() == KVPoll.SUCCESS
        row = decode_meta.read(room, expected_room=room)
        assert row is not None
        want = reference.generate(list(prompt), 2)
        assert row.first_token == want[0]
        item = ForwardItem(f"r{room}", (row.first_token,), len(prompt), tuple(pages),
                           swa_pages=tuple(swa), state_slot=slot)
        assert runner.forward(ForwardBatch((item,))) == [want[1]], room
