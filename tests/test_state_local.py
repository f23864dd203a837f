"""Hybrid state over the local backend: a chunked request's full pages, draft pages, last SWA
window, recurrent slot and index pages land byte-exact in the decode side's pools, and nothing
else there changes; pools that disagree are refused at the handshake."""

from __future__ import annotations

from random import Random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv.local import LocalKVManager, LocalKVSender, LocalTransferHub
from kv.local_decode import LocalDecodeManager, LocalKVReceiver
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError
from kv.pool_layout import KVLayout
from kv.state_pools import StateKind, StatePools
from kv.transfer import KVPoll, TransferUsageError
from tests.state_harness import (
    decode_the_colocated_tokens,
    kv_pool,
    land_across_a_chunk_boundary,
    land_case,
    state_pools,
)
from tests.strategies import chunked_prompts
from tests.transfer_harness import drive

ADDR = "local:state"


class _Pair:
    def __init__(self, prefill: StatePools, decode: StatePools | None, slots: int = 2) -> None:
        self.addr = ADDR
        self.hub = LocalTransferHub()
        self.prefill_meta, self.decode_meta = MetadataBuffers(slots), MetadataBuffers(slots)
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


def test_a_hybrid_prefill_over_the_local_backend_decodes_the_colocated_tokens() -> None:
    decode_the_colocated_tokens(lambda src, dst: _Pair(src, dst, slots=4))
