"""Hybrid state through a transfer backend: state pools of every kind filled with random bits,
a chunked request sent as the prefill scheduler sends it (``chunk_send``), and the check that
every pool's items landed byte-exact on the decode side and nothing else there changed.

Backends plug in a :class:`StatePair` (both managers over one bootstrap address);
``tests/test_state_local.py`` and ``tests/test_state_mooncake.py`` use it, and
:func:`decode_the_colocated_tokens` runs a hybrid reference model through the prefill scheduler
over such a pair.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from random import Random
from typing import Protocol

import attrs
import torch

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pages import pages_needed
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.state_pools import IndexPool, RecurrentPool, StateKind, StatePools, SWAPool, items_view
from kv.state_sends import chunk_send, state_tables, window_span
from kv.transfer import KVManager, KVPoll, KVReceiver, KVSender
from lifecycle import PrefillState
from scheduler.messages import NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch, ForwardItem
from tests.transfer_harness import drive, eventually

PS = 4
TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}


def kv_pool(pages: int, layout: KVLayout, layers: int = 2, page_size: int = PS) -> KVPool:
    return KVPool(num_layers=layers, num_pages=pages, page_size=page_size, kv_heads=2,
                  head_dim=3, layout=layout)


def state_pools(full_pages: int, swa_pages: int, slots: int, layout: KVLayout,
                window: int = 9, page_size: int = PS, full: KVPool | None = None) -> StatePools:
    """Every kind: an SWA pool of ``swa_pages``, ``slots`` recurrent slots (int64), index keys
    and a draft, beside ``full`` (a pool of ``full_pages`` by default)."""
    full = full or kv_pool(full_pages, layout, page_size=page_size)
    return StatePools(
        full,
        swa=SWAPool(window=window, pool=kv_pool(swa_pages, layout, 1, page_size),
                    full_pages=full_pages),
        recurrent=RecurrentPool.zeros(num_layers=2, num_slots=slots, state_size=5,
                                      dtype=torch.int64),
        index=IndexPool(num_layers=2, num_pages=full_pages, page_size=page_size, dim=3),
        draft=kv_pool(full_pages, layout, 1, page_size),
    )


def buffers(states: StatePools) -> list[torch.Tensor]:
    assert states.swa is not None and states.recurrent is not None
    assert states.index is not None and states.draft is not None
    return [states.full.buffer, states.draft.buffer, states.swa.pool.buffer,
            states.recurrent.buffer, states.index.buffer]


def items_view_of(tensor: torch.Tensor, like: KVPool | RecurrentPool | IndexPool) -> torch.Tensor:
    """``tensor`` (a copy of ``like``'s buffer) seen as :func:`items_view` sees ``like``."""
    return tensor.view(items_view(like).shape)


class StateReceiver(KVReceiver, Protocol):
    def send_metadata(self, pages: Sequence[int], slot: int,
                      state: Mapping[StateKind, Sequence[int]] | None = None) -> None: ...


class StateSender(KVSender, Protocol):
    def send_state(self, state: Mapping[StateKind, Sequence[int]]) -> None: ...


class StatePair(Protocol):
    """A prefill manager and a decode manager over one bootstrap address, with the metadata
    buffers each was given."""

    addr: str
    prefill: KVManager
    prefill_meta: MetadataBuffers
    decode_meta: MetadataBuffers

    def receiver(self, room: int) -> StateReceiver: ...

    def sender(self, room: int) -> StateSender: ...

    def close(self) -> None: ...


def post_destination(receiver: StateReceiver, pages: list[int], slot: int, window: list[int],
                     state_slot: int) -> None:
    """Give a room's destination with every state kind: the window's SWA pages, the recurrent
    slot and (at the full pool's page indices) the index pages."""
    receiver.send_metadata(pages, slot, state={
        StateKind.SWA: window, StateKind.RECURRENT: [state_slot], StateKind.INDEX: pages})


PairFactory = Callable[[StatePools, StatePools | None], StatePair]


def land_across_a_chunk_boundary(make_pair: PairFactory, layout: KVLayout) -> None:
    """18 tokens in chunks of 12 and 6: the window (9 tokens, [9, 18) -> pages 2..4) starts in
    the first chunk; pages 3, 4 and 10, 11 are runs on the prefill side, 0..4 on decode."""
    land(make_pair, state_pools(12, 9, 3, layout), state_pools(10, 6, 2, layout), 18, [12, 18],
         pages=[9, 3, 4, 10, 11], dst_pages=[0, 1, 2, 3, 4], dst_window=[5, 1, 3], dst_slot=1)


def land_case(make_pair: PairFactory, page_size: int, length: int, progress: list[int],
              window: int, layout: KVLayout, rng: Random) -> None:
    """A prompt of ``length`` computed up to each of ``progress`` on pages ``rng`` scatters
    over both sides' pools (a few more than it needs)."""
    n = pages_needed(length, page_size)
    spans = len(window_span(length, window, page_size))
    land(make_pair, state_pools(n + 3, n + 1, 2, layout, window, page_size),
         state_pools(n + 2, spans + 2, 3, layout, window, page_size), length, progress,
         pages=rng.sample(range(n + 3), n), dst_pages=rng.sample(range(n + 2), n),
         dst_window=rng.sample(range(spans + 2), spans), dst_slot=rng.randrange(3))


def land(make_pair: PairFactory, src: StatePools,
         dst: StatePools, length: int, progress: list[int], pages: list[int],
         dst_pages: list[int], dst_window: list[int], dst_slot: int) -> None:
    """Send a request of ``length`` tokens on ``pages`` of ``src``, computed in chunks up to
    each of ``progress``, as the scheduler would (``chunk_send``), into ``dst``; then assert
    that every pool's items landed byte-exact and nothing else in ``dst`` changed."""
    ps = src.full.page_size
    for tensor in buffers(src):
        tensor.copy_(torch.randint(1, 99, tensor.shape))
    before = [t.clone() for t in buffers(dst)]
    assert src.swa is not None and src.window is not None
    src.swa.grow(pages)
    slot = src.take_slot()
    assert src.recurrent is not None and slot is not None
    src.recurrent.buffer[:, slot] = torch.arange(10).view(2, 5) + 1
    window = list(window_span(length, src.window, ps))
    pair = make_pair(src, dst)
    try:
        receiver = pair.receiver(7)
        receiver.init()
        post_destination(receiver, dst_pages, 0, dst_window, dst_slot)
        sender = pair.sender(7)
        assert drive(pair.prefill, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == (
            KVPoll.WAITING_FOR_INPUT)
        sender.init(len(pages), 1)
        pair.prefill_meta.write(1, first_token=5, cached_tokens=0, logprob=None, room=7)
        sent = 0
        for computed in progress:
            last = computed == length
            send = chunk_send(pages, length=length, sent=sent, computed=computed, last=last,
                              page_size=ps, tables=state_tables(src, pages, slot, last))
            if not send.goes:
                continue
            if send.state:
                sender.send_state(send.state)
            sender.send(list(send.pages), last)
            sent = send.sent
        assert drive(pair.prefill, sender, TERMINAL)[-1] == KVPoll.SUCCESS
        eventually(lambda: receiver.poll() == KVPoll.SUCCESS, "the receiver to conclude")
        assert pair.decode_meta.read(0, expected_room=7) is not None
    finally:
        pair.close()
    assert dst.swa is not None and dst.recurrent is not None and dst.index is not None
    assert dst.draft is not None and src.draft is not None and src.index is not None
    landed = [
        (src.full, dst.full, pages, dst_pages),
        (src.draft, dst.draft, pages, dst_pages),
        (src.swa.pool, dst.swa.pool, src.swa.translate([pages[i] for i in window]), dst_window),
        (src.recurrent, dst.recurrent, [slot], [dst_slot]),
        (src.index, dst.index, pages, dst_pages),
    ]
    for (a, b, src_items, dst_items), old in zip(landed, before, strict=True):
        got, want = items_view(b), items_view(a)
        assert torch.equal(got[:, dst_items], want[:, src_items])
        others = [i for i in range(got.shape[1]) if i not in dst_items]
        assert torch.equal(got[:, others], items_view_of(old, b)[:, others])


MIXED = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=6), layers=4, swa_layers=(0, 2),
                                sliding_window=6, recurrent_layers=(1,)))


def _model_states(model: LlamaModel, pages: int, swa_pages: int, slots: int) -> StatePools:
    c = model.config
    return StatePools(
        model.make_pool(num_pages=pages, page_size=PS),
        swa=SWAPool(window=c.sliding_window, full_pages=pages,
                    pool=model.make_swa_pool(num_pages=swa_pages, page_size=PS)),
        recurrent=RecurrentPool(model.make_states(slots)))


def decode_the_colocated_tokens(make_pair: PairFactory) -> None:
    """The prefill scheduler computes hybrid prompts in chunks and sends the last window and the
    recurrent state through the pair's backend (4 metadata slots a side); the decode side's
    runner then computes the second token from what landed, with only the window's SWA pages:
    it must be the colocated one."""
    model, c = MIXED, MIXED.config
    src, dst = _model_states(model, 24, 20, 2), _model_states(model, 24, 20, 4)
    assert src.swa is not None and src.recurrent is not None
    assert dst.swa is not None and dst.recurrent is not None
    # What did not land reads as NaN (or a wrong state): the second token would not match.
    for pool in (dst.full, dst.swa.pool):
        pool.buffer.fill_(float("nan"))
    dst.recurrent.buffer.fill_(7777)
    responses: list[Response] = []
    pair = make_pair(src, dst)
    try:
        sched = PrefillScheduler(
            config=SchedulerConfig(page_size=PS, chunked_prefill_size=8, check_invariants=True),
            runner=PagedModelRunner(model, src.full, swa_pool=src.swa.pool,
                                    states=src.recurrent.buffer),
            kv=pair.prefill, metadata=pair.prefill_meta, slots=SlotAllocator(4),
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
            receiver = pair.receiver(room)
            receiver.init()
            receiver.send_metadata(pages[: pages_needed(n, PS)], room, state={
                StateKind.SWA: swa[: len(window)], StateKind.RECURRENT: [slot]})
            landing[room] = (receiver, pages, [-1] * window.start + swa, slot)
            sched.submit(NewRequest(f"r{room}", prompt, bootstrap_host="decode",
                                    bootstrap_port=1, bootstrap_room=room))
        try:
            sched.run_until(lambda: len(responses) == len(prompts), timeout=60)
            sched.run_until(sched.idle, timeout=60)
        finally:
            sched.close()
        assert [r.state for r in responses] == [PrefillState.DONE] * len(prompts)
        runner = PagedModelRunner(model, dst.full, swa_pool=dst.swa.pool,
                                  states=dst.recurrent.buffer)
        reference = ReferenceModel(model)
        assert src.all_free()
        for room, prompt in prompts.items():
            receiver, pages, swa, slot = landing[room]
            eventually(lambda r=receiver: r.poll() == KVPoll.SUCCESS,
                       f"room {room} to land")
            row = pair.decode_meta.read(room, expected_room=room)
            assert row is not None
            want = reference.generate(list(prompt), 2)
            assert row.first_token == want[0]
            item = ForwardItem(f"r{room}", (row.first_token,), len(prompt), tuple(pages),
                               swa_pages=tuple(swa), state_slot=slot)
            assert runner.forward(ForwardBatch((item,))) == [want[1]], room
    finally:
        pair.close()
