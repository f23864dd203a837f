"""Hybrid state between ranks of different parallel layouts: a whole model's pools of every kind
(full, draft, SWA, recurrent, index) filled with random bits, each rank's shard of them (its KV
heads and recurrent channels of its stage's layers), and the check that every decode rank's
pools hold byte-exactly its shard of what was sent and nothing else changed.

A backend's test builds a :class:`Mesh` of its managers over these pools
(``tests/test_state_layouts_local.py``, ``tests/test_state_layouts_mooncake.py``); this module
runs rooms through it as the prefill scheduler would and checks what landed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kv.pages import pages_needed
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.state_pools import IndexPool, RecurrentPool, StateKind, StatePools, SWAPool
from kv.state_sends import ChunkSend, chunk_send, state_tables
from kv.transfer import KVPoll
from tests.sliced_harness import rank_place
from tests.transfer_harness import drive

HEADS, DIM, PS, PAGES, SWA_PAGES = 4, 3, 2, 12, 10
FULL_LAYERS, STATE_LAYERS, WIDTH, SLOTS, WINDOW = 4, 2, 8, 3, 5
LENGTH, PROGRESS = 11, (6, 11)  # two chunks; the window [6, 11) starts in the first
SRC_PAGES = [9, 2, 3, 4, 10, 11]
SRC_SLOT = 1
NAMES = ("full", "draft", "swa", "recurrent", "index")
AnyPool = KVPool | RecurrentPool | IndexPool
TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}


def dst_items(d: int) -> dict[str, list[int]]:
    """Where decode rank ``d``'s room lands, in other runs than the source's."""
    pages = [(5 * d + 2 * i + 1) % PAGES for i in range(len(SRC_PAGES))]
    return {"full": pages, "draft": pages, "swa": [(3 + d + 2 * i) % SWA_PAGES for i in range(3)],
            "recurrent": [2 - d], "index": pages}


def place(t: int, tp: int, *, heads: int = HEADS, s: int = 0, pp: int = 1) -> RankPlace:
    return rank_place(t, tp, heads=heads, layers=FULL_LAYERS, pp=s, pp_size=pp)


def state_layers(p: RankPlace) -> range:
    """The layers of each state pool the stage at ``p`` holds."""
    return range(p.pp_rank * STATE_LAYERS // p.pp_size,
                 (p.pp_rank + 1) * STATE_LAYERS // p.pp_size)


def rank_pools(p: RankPlace, layout: KVLayout) -> StatePools:
    """Zeroed pools of every kind for the rank at ``p`` (its heads, channels and layers)."""
    held = state_layers(p)

    def kv(layers: int, pages: int) -> KVPool:
        return KVPool(num_layers=layers, num_pages=pages, page_size=PS,
                      kv_heads=p.heads_per_rank, head_dim=DIM, layout=layout)

    stage = {name: held for name in NAMES[1:]} if p.pp_size > 1 else None
    return StatePools(
        kv(len(p.layers), PAGES),
        draft=kv(len(held), PAGES),
        swa=SWAPool(window=WINDOW, pool=kv(len(held), SWA_PAGES), full_pages=PAGES),
        recurrent=RecurrentPool.zeros(num_layers=len(held), num_slots=SLOTS,
                                      state_size=WIDTH // p.tp_size, dtype=torch.int64),
        index=IndexPool(num_layers=len(held), num_pages=PAGES, page_size=PS, dim=DIM),
        stage=stage)


def pool(states: StatePools, name: str) -> AnyPool:
    return states.full if name == "full" else states.named_pools()[name]


def canonical(pool: AnyPool) -> torch.Tensor:
    """A pool with its items on dimension 2 (KV: layer-major view) or 1 (state)."""
    return pool.by_layer() if isinstance(pool, KVPool) else pool.buffer


def item_dim(name: str) -> int:
    return 2 if name in ("full", "draft", "swa") else 1


def shard(whole: StatePools, name: str, p: RankPlace) -> torch.Tensor:
    """The part of ``whole``'s pool ``name`` the rank at ``p`` holds."""
    t = canonical(pool(whole, name))
    layers = p.layers if name == "full" else state_layers(p)
    t = t[layers.start : layers.stop]
    if name in ("full", "draft", "swa"):
        heads = p.tp_layout.heads_of(p.tp_rank)
        return t[:, :, :, :, heads.start : heads.stop]
    if name == "recurrent":
        w = WIDTH // p.tp_size
        return t[:, :, p.tp_rank * w : (p.tp_rank + 1) * w]
    return t


def whole_model(seed: int, layout: KVLayout) -> StatePools:
    """The unsharded pools, random."""
    whole = rank_pools(place(0, 1), layout)
    gen = torch.Generator().manual_seed(seed)
    for name in NAMES:
        t = canonical(pool(whole, name))
        t.copy_(torch.randint(1, 1 << 20, t.shape, generator=gen).to(t.dtype))
    assert whole.swa is not None
    whole.swa.grow(SRC_PAGES)
    return whole


def fill(states: StatePools, whole: StatePools, p: RankPlace) -> None:
    """Give the prefill rank at ``p`` its shard of ``whole``; its SWA pages and recurrent slot
    for the request are ``whole``'s (every rank of a mesh allocates alike)."""
    for name in NAMES:
        canonical(pool(states, name)).copy_(shard(whole, name, p))
    assert states.swa is not None and whole.swa is not None
    states.swa.grow(SRC_PAGES)
    assert states.swa.translate(SRC_PAGES) == whole.swa.translate(SRC_PAGES)


def sends(states: StatePools) -> list[ChunkSend]:
    """The chunks of the request as the scheduler sends them."""
    out, sent = [], 0
    for computed in PROGRESS:
        last = computed == LENGTH
        send = chunk_send(SRC_PAGES, length=LENGTH, sent=sent, computed=computed, last=last,
                          page_size=PS, tables=state_tables(states, SRC_PAGES, SRC_SLOT, last))
        out.append(send)
        sent = send.sent
    return out


def source_items(whole: StatePools) -> dict[str, list[int]]:
    assert whole.swa is not None
    state = sends(whole)[-1].state
    return {"full": SRC_PAGES, "draft": SRC_PAGES, "swa": list(state[StateKind.SWA]),
            "recurrent": [SRC_SLOT], "index": SRC_PAGES}


def destination(d: int) -> tuple[list[int], dict[StateKind, list[int]]]:
    """Decode rank ``d``'s pages and where each state kind goes."""
    items = dst_items(d)
    assert len(items["swa"]) == pages_needed(LENGTH, PS) - (LENGTH - WINDOW) // PS
    return items["full"], {StateKind(k): items[k] for k in ("swa", "recurrent", "index")}


def check_landed(whole: StatePools, decode: Mapping[int, tuple[RankPlace, StatePools]],
                 before: Mapping[int, list[torch.Tensor]]) -> None:
    """Every decode rank holds its shard of the sent items at its destination, bit for bit,
    and nothing else in its pools changed."""
    src = source_items(whole)
    for d, (p, states) in decode.items():
        dst = dst_items(d)
        for name, old in zip(NAMES, before[d], strict=True):
            got = canonical(pool(states, name))
            dim = item_dim(name)
            want = shard(whole, name, p).index_select(dim, torch.tensor(src[name]))
            landed = got.index_select(dim, torch.tensor(dst[name]))
            assert torch.equal(landed, want), f"decode rank {d}: {name}"
            others = torch.tensor([i for i in range(got.shape[dim]) if i not in dst[name]])
            assert torch.equal(got.index_select(dim, others), old.index_select(dim, others)), (
                f"decode rank {d}: {name} changed outside the destination")


def snapshot(states: StatePools) -> list[torch.Tensor]:
    return [canonical(pool(states, name)).clone() for name in NAMES]


@attrs.define
class Mesh:
    """Every rank of a prefill server (its manager and pools, stage-major) and of a decode
    server (by TP rank: its place, pools and manager), behind bootstrap address ``addr``."""

    addr: str
    whole: StatePools
    prefill: list[tuple[Any, StatePools]]
    decode: dict[int, tuple[RankPlace, StatePools, Any]]

    def landed(self) -> dict[int, tuple[RankPlace, StatePools]]:
        return {d: (p, states) for d, (p, states, _) in self.decode.items()}


def receivers(mesh: Mesh, room: int) -> list[Any]:
    """Every decode rank's receiver for ``room``, its destination given."""
    out = []
    for d, (_, _, manager) in mesh.decode.items():
        rx = manager.create_receiver(mesh.addr, room)
        rx.init()
        pages, state = destination(d)
        rx.send_metadata(pages, d, state=state)
        out.append(rx)
    return out


def send_all(manager: Any, states: StatePools, tx: Any, room: int) -> None:
    """Bootstrap ``tx`` and send the request's chunks, the state with the last."""
    assert drive(manager, tx, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    tx.init(len(SRC_PAGES), 2)
    manager.metadata.write(2, first_token=42, cached_tokens=0, logprob=None, room=room)
    for send in sends(states):
        if send.state:
            tx.send_state(send.state)
        tx.send(list(send.pages), send.last)


def run_room(mesh: Mesh, room: int = 5) -> tuple[list[Any], list[Any]]:
    """Send ``room`` from every prefill rank; every end must succeed and every decode rank hold
    its shard. Returns the senders and the receivers."""
    before = {d: snapshot(states) for d, (_, states, _) in mesh.decode.items()}
    ends = receivers(mesh, room)
    senders = [m.create_sender(mesh.addr, room) for m, _ in mesh.prefill]
    for (m, states), tx in zip(mesh.prefill, senders, strict=True):
        send_all(m, states, tx, room)
    for (m, _), tx in zip(mesh.prefill, senders, strict=True):
        assert drive(m, tx, TERMINAL)[-1] == KVPoll.SUCCESS
    for (_, _, m), rx in zip(mesh.decode.values(), ends, strict=True):
        assert drive(m, rx, TERMINAL)[-1] == KVPoll.SUCCESS
    check_landed(mesh.whole, mesh.landed(), before)
    return senders, ends


def wait_for_the_state_only_rank(mesh: Mesh, room: int) -> tuple[list[Any], list[Any]]:
    """Prefill TP 2 -> decode TP 1 of a one-head model: rank 1 owes the decode rank only its
    recurrent channels; the decode room must wait for it."""
    before = {0: snapshot(mesh.decode[0][1])}
    (rx,) = receivers(mesh, room)
    senders = [m.create_sender(mesh.addr, room) for m, _ in mesh.prefill]
    for (m, states), tx in zip(mesh.prefill, senders, strict=True):
        assert rx.poll() == KVPoll.TRANSFERRING
        send_all(m, states, tx, room)
        assert drive(m, tx, TERMINAL)[-1] == KVPoll.SUCCESS
    assert drive(mesh.decode[0][2], rx, TERMINAL)[-1] == KVPoll.SUCCESS
    check_landed(mesh.whole, mesh.landed(), before)
    return senders, [rx]


def abort_the_state_only_rank(mesh: Mesh, room: int) -> tuple[list[Any], list[Any]]:
    """As :func:`wait_for_the_state_only_rank`, but that rank aborts after the other sent
    everything: the room fails on every end."""
    (rx,) = receivers(mesh, room)
    senders = [m.create_sender(mesh.addr, room) for m, _ in mesh.prefill]
    (first, first_states), (second, _) = mesh.prefill
    assert drive(second, senders[1], {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    send_all(first, first_states, senders[0], room)
    senders[1].abort()
    assert drive(mesh.decode[0][2], rx, TERMINAL)[-1] == KVPoll.FAILED
    assert drive(first, senders[0], TERMINAL)[-1] == KVPoll.FAILED
    return senders, [rx]
