"""The local (in-process) transfer backend: copies, pairing, aborts from both sides, errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager, LocalKVReceiver
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError, KVPool
from kv.pool_layout import KVLayout
from kv.transfer import REASON_PEER_ABORTED, KVPoll, TransferUsageError
from tests.transfer_harness import drive, eventually

ADDR = "local:test"
_TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}


def _pool(num_pages: int = 64, dtype: torch.dtype = torch.float32,
          layout: KVLayout = KVLayout.LAYER_MAJOR, **kw: int) -> KVPool:
    geometry = {"num_layers": 3, "page_size": 2, "kv_heads": 2, "head_dim": 4, **kw}
    return KVPool(num_pages=num_pages, dtype=dtype, layout=layout, **geometry)


class _Side:
    """A prefill manager and a decode manager connected through one hub."""

    def __init__(self, prefill_pool: KVPool, decode_pool: KVPool) -> None:
        self.hub = LocalTransferHub()
        self.prefill_meta = MetadataBuffers(4)
        self.decode_meta = MetadataBuffers(4)
        self.prefill = LocalKVManager(
            prefill_pool, self.prefill_meta, hub=self.hub, bootstrap_addr=ADDR
        )
        self.decode = LocalDecodeManager(decode_pool, self.decode_meta, hub=self.hub)

    def receiver(self, room: int, pages: list[int], slot: int = 0) -> LocalKVReceiver:
        receiver = self.decode.create_receiver(ADDR, room)
        receiver.init()
        receiver.send_metadata(pages, slot)
        return receiver

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def side() -> Iterator[_Side]:
    s = _Side(_pool(), _pool())
    yield s
    s.close()


def _transfer(side: _Side, room: int, src: list[int], dst: list[int], chunks: int) -> None:
    receiver = side.receiver(room, dst, slot=1)
    sender = side.prefill.create_sender(ADDR, room)
    assert sender.poll() == KVPoll.WAITING_FOR_INPUT
    sender.init(len(src), 2)
    side.prefill_meta.write(2, first_token=11, cached_tokens=0, logprob=None, room=room)
    bounds = [len(src) * i // chunks for i in range(chunks + 1)]
    for i in range(chunks):
        sender.send(src[bounds[i] : bounds[i + 1]], last=i == chunks - 1)
    assert drive(side.prefill, sender, _TERMINAL)[-1] == KVPoll.SUCCESS
    eventually(lambda: receiver.poll() == KVPoll.SUCCESS, "the receiver to conclude")


# Pages of 384 KiB over all layers: a run of three or more takes the parallel (torch) copy.
LARGE_PAGES = {"page_size": 16, "kv_heads": 8, "head_dim": 128}


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(
    ("dtype", "scattered", "geometry"),
    [
        (torch.float32, False, {}),
        (torch.bfloat16, False, {}),
        (torch.float32, True, {}),
        (torch.float32, False, LARGE_PAGES),
    ],
    ids=["runs-f32", "runs-bf16", "scattered-f32", "large-runs-f32"],
)
def test_multi_chunk_transfer_is_byte_exact(
    dtype: torch.dtype, scattered: bool, geometry: dict[str, int], layout: KVLayout
) -> None:
    side = _Side(_pool(dtype=dtype, layout=layout, **geometry),
                 _pool(dtype=dtype, layout=layout, **geometry))
    try:
        generator = torch.Generator().manual_seed(1)
        bits = torch.randint(-(2**15), 2**15, side.prefill.pool.buffer.shape, generator=generator)
        side.prefill.pool.buffer.copy_(bits.to(dtype))
        if scattered:  # ~40 one-page runs: the gather/scatter path
            perm = torch.randperm(64, generator=generator).tolist()
            src, dst = perm[:40], perm[24:]
        else:  # a few long runs: one slice copy per run
            src = [*range(3, 20), *range(30, 40), 50, 51]
            dst = [*range(5, 22), *range(40, 52)]
        _transfer(side, room=77, src=src, dst=dst, chunks=3)
        decode = side.decode.pool.by_layer()
        prefill = side.prefill.pool.by_layer()
        assert torch.equal(
            decode[:, :, dst].view(torch.uint8), prefill[:, :, src].view(torch.uint8)
        )
        untouched = [p for p in range(64) if p not in dst]
        assert decode[:, :, untouched].abs().sum() == 0
        row = side.decode_meta.read(1, expected_room=77)
        assert row is not None and row.first_token == 11
        stats = side.prefill.stats()
        assert stats.pages == len(src)
        assert stats.bytes == len(src) * side.prefill.pool.page_bytes * 3 * 2
    finally:
        side.close()


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        ({}, {"page_size": 4, "dtype": torch.float16}, r"page_size: 2 vs 4.*dtype"),
        ({"layout": KVLayout.PAGE_MAJOR}, {}, r"layout: page_major vs layer_major"),
    ],
    ids=["page_size-dtype", "layout"],
)
def test_geometry_mismatch_is_a_clear_error_at_handshake(
    prefill: dict[str, Any], decode: dict[str, Any], message: str
) -> None:
    side = _Side(_pool(**prefill), _pool(**decode))
    try:
        receiver = side.decode.create_receiver(ADDR, 1)
        with pytest.raises(KVGeometryError, match=message):
            receiver.init()
    finally:
        side.close()


def test_unknown_prefill_address_fails_the_receiver(side: _Side) -> None:
    receiver = side.decode.create_receiver("local:nowhere", 3)
    receiver.init()
    assert receiver.poll() == KVPoll.FAILED
    assert "no prefill server" in receiver.failure_exception().reason


def test_decode_first_and_prefill_first_both_pair(side: _Side) -> None:
    side.receiver(1, [0])
    early = side.prefill.create_sender(ADDR, 1)
    assert early.poll() == KVPoll.WAITING_FOR_INPUT
    late = side.prefill.create_sender(ADDR, 2)
    assert late.poll() == KVPoll.BOOTSTRAPPING
    side.receiver(2, [1])
    assert drive(side.prefill, late, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    with pytest.raises(TransferUsageError, match="live sender"):
        side.prefill.create_sender(ADDR, 2)


def test_abort_from_decode_fails_the_sender_and_vice_versa(side: _Side) -> None:
    receiver = side.receiver(5, [0, 1])
    sender = side.prefill.create_sender(ADDR, 5)
    sender.init(2, 0)
    receiver.abort()
    assert drive(side.prefill, sender, _TERMINAL)[-1] == KVPoll.FAILED
    assert sender.failure_exception().reason == REASON_PEER_ABORTED

    receiver = side.receiver(6, [2])
    sender = side.prefill.create_sender(ADDR, 6)
    sender.abort()
    assert receiver.poll() == KVPoll.FAILED
    assert receiver.failure_exception().reason == REASON_PEER_ABORTED
    assert 6 in [side.decode.ready.get(timeout=1) for _ in range(side.decode.ready.qsize())]


def test_a_receiver_abort_before_the_sender_exists_fails_it_on_creation(side: _Side) -> None:
    side.receiver(8, [0]).abort()
    sender = side.prefill.create_sender(ADDR, 8)
    assert sender.poll() == KVPoll.FAILED


def test_bad_pages_are_usage_errors_and_short_destinations_fail(side: _Side) -> None:
    receiver = side.decode.create_receiver(ADDR, 9)
    receiver.init()
    with pytest.raises(TransferUsageError, match="page 64 is not in the decode pool"):
        receiver.send_metadata([1, 64], 0)
    with pytest.raises(TransferUsageError, match="slot 4"):
        receiver.send_metadata([1], 4)
    receiver.send_metadata([1, 2], 0)
    sender = side.prefill.create_sender(ADDR, 9)
    sender.init(2, 0)
    with pytest.raises(TransferUsageError, match="page -1 is not in the prefill pool"):
        sender.send([-1], last=False)
    assert sender.sent_pages == 0

    side.receiver(10, [3])
    short = side.prefill.create_sender(ADDR, 10)
    short.init(2, 0)
    assert short.poll() == KVPoll.FAILED
    assert "gave 1 destination pages, 2 are needed" in short.failure_exception().reason


class _GatedPool(KVPool):
    """A decode pool whose copies wait for a gate, or raise once: a slow or broken device."""

    def __init__(self) -> None:
        super().__init__(num_layers=3, num_pages=64, page_size=2, kv_heads=2, head_dim=4)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail_next = False

    def page_view(self) -> torch.Tensor:
        self.entered.set()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")
        assert self.gate.wait(10), "test gate never opened"
        return super().page_view()


def test_an_aborted_room_is_quiescent_only_after_its_copy_ends() -> None:
    decode_pool = _GatedPool()
    side = _Side(_pool(), decode_pool)
    try:
        receiver = side.receiver(12, [0, 1])
        sender = side.prefill.create_sender(ADDR, 12)
        sender.init(2, 0)
        sender.send([4, 5], last=False)
        assert decode_pool.entered.wait(10)
        sender.abort()
        assert not sender.quiescent() and not receiver.quiescent()
        decode_pool.gate.set()
        # Quiescence is pushed: wait for the room on the ready queue (Empty fails the test).
        while not sender.quiescent():
            assert side.prefill.ready.get(timeout=10) == 12
        assert receiver.quiescent()
        assert sender.poll() == KVPoll.FAILED
    finally:
        decode_pool.gate.set()
        side.close()


def test_a_copy_error_fails_the_room_and_the_worker_carries_on() -> None:
    decode_pool = _GatedPool()
    decode_pool.gate.set()
    decode_pool.fail_next = True
    side = _Side(_pool(), decode_pool)
    try:
        receiver = side.receiver(20, [0])
        sender = side.prefill.create_sender(ADDR, 20)
        sender.init(1, 0)
        sender.send([3], last=True)
        assert drive(side.prefill, sender, _TERMINAL)[-1] == KVPoll.FAILED
        assert "device lost" in sender.failure_exception().reason
        assert receiver.poll() == KVPoll.FAILED
        _transfer(side, room=21, src=[1, 2], dst=[5, 6], chunks=1)
    finally:
        side.close()


def test_close_joins_the_worker_and_refuses_new_senders() -> None:
    side = _Side(_pool(), _pool())
    side.close()
    side.close()
    with pytest.raises(TransferUsageError, match="closed"):
        side.prefill.create_sender(ADDR, 1)
    names = [t.name for t in threading.enumerate()]
    assert f"kv-local-transfer[{ADDR}]" not in names
