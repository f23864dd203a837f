"""A hybrid request aborted while its state is being copied leaks nothing on either side.

The decode peer's recurrent pool holds the copy of the last chunk's state at a gate (the
transfer worker waits inside it until the test opens it), so the abort lands, deterministically,
while the transfer may still write the decode side's pages, SWA pages and slot and read the
prefill side's. Both sides answer at once, keep all of it until the transfer is quiescent, and
then free it, once: every pool ends full on both sides.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import attrs
import pytest
import torch

from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.state_pools import RecurrentPool, StatePools, SWAPool
from lifecycle import DecodeState, FailureReason, PrefillState, SamplingParams
from scheduler.decode import DecodeConfig, DecodePeer, DecodeResponse
from scheduler.messages import NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.model.side_pools import HybridConfig, build_side
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.stepping import step_until

MODEL = LlamaModel(
    attrs.evolve(
        ModelConfig.tiny(seed=5),
        layers=4,
        swa_layers=(0, 2),
        sliding_window=6,
        recurrent_layers=(1,),
    )
)
PS, PAGES, SLOTS, HOST, PORT = 4, 32, 2, "local", 7
WORKER = "kv-local-transfer"


class GatedRecurrentPool(RecurrentPool):
    """Recurrent slots whose copies by a transfer worker wait for :attr:`gate`."""

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__(buffer)
        self.gate, self.entered = threading.Event(), threading.Event()

    def items_view(self) -> torch.Tensor:
        if threading.current_thread().name.startswith(WORKER):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return super().items_view()


class Pair:
    """A prefill scheduler and a decode peer of ``MODEL`` over the local backend, by hand (the
    decode side's recurrent pool gated)."""

    def __init__(self) -> None:
        hub = LocalTransferHub()
        self.prefill_answers: list[Response] = []
        self.decode_answers: list[DecodeResponse] = []
        side = build_side(
            MODEL, MODEL.make_pool(num_pages=PAGES, page_size=PS), HybridConfig(state_slots=SLOTS)
        )
        assert side.states is not None
        self.prefill_states = side.states
        prefill_meta = MetadataBuffers(4)
        self.prefill_kv = LocalKVManager(
            side.states.full,
            prefill_meta,
            hub=hub,
            bootstrap_addr=f"{HOST}:{PORT}",
            states=side.states,
        )
        self.prefill = PrefillScheduler(
            config=SchedulerConfig(page_size=PS, chunked_prefill_size=8, check_invariants=True),
            runner=side.runner,
            kv=self.prefill_kv,
            metadata=prefill_meta,
            slots=SlotAllocator(4),
            on_response=self.prefill_answers.append,
            states=side.states,
        )
        pool = MODEL.make_pool(num_pages=PAGES, page_size=PS)
        swa = MODEL.make_swa_pool(num_pages=PAGES, page_size=PS)
        self.recurrent = GatedRecurrentPool(MODEL.make_states(SLOTS))
        self.decode_states = StatePools(
            pool, swa=SWAPool(window=6, pool=swa, full_pages=PAGES), recurrent=self.recurrent
        )
        decode_meta = MetadataBuffers(4)
        self.decode_kv = LocalDecodeManager(pool, decode_meta, hub=hub, states=self.decode_states)
        self.decode = DecodePeer(
            runner=PagedModelRunner(MODEL, pool, swa_pool=swa, states=self.recurrent.buffer),
            kv=self.decode_kv,
            metadata=decode_meta,
            slots=SlotAllocator(4),
            eos_token_id=None,
            config=DecodeConfig(check_invariants=True),
            on_response=self.decode_answers.append,
            states=self.decode_states,
        )

    def step_until(self, done: Callable[[], bool], what: str) -> None:
        step_until(
            lambda: self.prefill.step() | self.decode.step(),
            done,
            30.0,
            lambda: f"timed out waiting for {what}",
        )

    def close(self) -> None:
        self.recurrent.gate.set()
        self.prefill.close()
        self.prefill_kv.close()
        self.decode_kv.close()


def held(states: StatePools) -> tuple[int, int, int]:
    """Pages, SWA pages and recurrent slots in use."""
    assert states.swa is not None and states.recurrent is not None
    rec = states.recurrent
    return (
        states.full.allocator.in_use(),
        states.swa.pool.allocator.in_use(),
        rec.num_slots - rec.allocator.available(),
    )


@pytest.mark.parametrize("aborts", ["both", "prefill", "decode"])
def test_an_abort_mid_state_transfer_leaks_no_page_or_slot(aborts: str) -> None:
    pair = Pair()
    try:
        prompt = tuple((7 * i + 3) % 250 for i in range(19))  # 5 pages, chunks of 8
        new = NewRequest(
            "r",
            prompt,
            bootstrap_host=HOST,
            bootstrap_port=PORT,
            bootstrap_room=9,
            sampling=SamplingParams(max_new_tokens=6),
        )
        pair.prefill.submit(new)
        pair.decode.submit(new)
        pair.step_until(pair.recurrent.entered.is_set, "the state copy to start")
        # The worker is inside the last chunk's state copy: everything is held on both sides.
        assert held(pair.prefill_states) == (5, 5, 1)
        assert held(pair.decode_states) == (5, 5, 1)
        if aborts in ("both", "prefill"):
            pair.prefill.abort("r")
        if aborts in ("both", "decode"):
            pair.decode.abort("r")
        pair.step_until(lambda: bool(pair.prefill_answers and pair.decode_answers), "both answers")
        (p,), (d,) = pair.prefill_answers, pair.decode_answers
        assert p.state is PrefillState.FAILED and d.state is DecodeState.FAILED
        assert FailureReason.ABORTED in (p.reason, d.reason)
        # Ended, but the copy may still read and write them: nothing is freed yet.
        for _ in range(3):
            pair.prefill.step()
            pair.decode.step()
        assert held(pair.prefill_states) == (5, 5, 1)
        assert held(pair.decode_states) == (5, 5, 1)
        pair.prefill.check_invariants()
        pair.decode.check_invariants()
        assert not pair.prefill.idle() and not pair.decode.idle()
        pair.recurrent.gate.set()
        pair.step_until(lambda: pair.prefill.idle() and pair.decode.idle(), "both sides idle")
        assert held(pair.prefill_states) == held(pair.decode_states) == (0, 0, 0)
        assert pair.prefill.slots.available() == pair.decode.slots.available() == 4
        pair.prefill.check_invariants()
        pair.decode.check_invariants()
        assert len(pair.prefill_answers) == len(pair.decode_answers) == 1
    finally:
        pair.close()


def test_a_decode_peer_without_the_state_pools_its_manager_receives_into_is_refused() -> None:
    """Built without ``states=`` beside a manager that receives into state pools, the peer
    would take every request and fail each one at its transfer (`state kinds differ`)."""
    pool = MODEL.make_pool(num_pages=PAGES, page_size=PS)
    side = build_side(MODEL, pool, HybridConfig(state_slots=SLOTS))
    assert side.states is not None
    meta = MetadataBuffers(4)
    kv = LocalDecodeManager(pool, meta, hub=LocalTransferHub(), states=side.states)
    try:
        with pytest.raises(ValueError, match="receives into state pools the peer was not given"):
            DecodePeer(runner=side.runner, kv=kv, metadata=meta, slots=SlotAllocator(4),
                       eos_token_id=None)
    finally:
        kv.close()
