"""Hybrid state between parallel layouts over the local backend (every rank in one process):
the draft and SWA pools' head slices, the recurrent state's channels and the index pages land
byte-exact on every decode rank for prefill TP {1, 2} x decode TP {1, 2}, GQA replicas and
prefill PP 2 -> decode PP 1; a decode rank waits for every prefill rank that owes it state; a
failure on one rank fails all; pools a layout cannot serve are refused naming both values."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest

from kv.local import LocalKVManager, LocalKVSender, LocalTransferHub
from kv.local_decode import LocalDecodeManager, LocalKVReceiver
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.state_pools import RecurrentPool, StatePools
from kv.transfer import KVPoll
from tests.state_layout_harness import (
    SRC_PAGES,
    check_landed,
    destination,
    fill,
    place,
    rank_pools,
    sends,
    snapshot,
    whole_model,
)
from tests.transfer_harness import drive, eventually

ADDR = "local:state-layouts"
TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}


@attrs.define
class Mesh:
    hub: LocalTransferHub
    whole: StatePools
    prefill: list[tuple[LocalKVManager, StatePools]]
    decode: dict[int, tuple[RankPlace, StatePools, LocalDecodeManager]]

    def close(self) -> None:
        for m, _ in self.prefill:
            m.close()


def make_mesh(tp: int, td: int, *, pp: int = 1, heads: int = 4,
              layout: KVLayout = KVLayout.LAYER_MAJOR,
              decode_pools: StatePools | None = None) -> Mesh:
    hub, whole = LocalTransferHub(), whole_model(tp * 10 + td + pp, layout)
    prefill = []
    for s in range(pp):
        for t in range(tp):
            p = place(t, tp, heads=heads, s=s, pp=pp)
            states = rank_pools(p, layout)
            fill(states, whole, p)
            prefill.append((LocalKVManager(states.full, MetadataBuffers(4), hub=hub,
                                           bootstrap_addr=ADDR, place=p, states=states), states))
    decode = {}
    for d in range(td):
        p = place(d, td, heads=heads)
        states = decode_pools or rank_pools(p, layout)
        decode[d] = (p, states, LocalDecodeManager(states.full, MetadataBuffers(4), hub=hub,
                                                   place=p, states=states))
    return Mesh(hub, whole, prefill, decode)


@pytest.fixture
def meshes() -> Iterator[list[Mesh]]:
    made: list[Mesh] = []
    yield made
    for m in made:
        m.close()


def receivers(mesh: Mesh, room: int) -> list[LocalKVReceiver]:
    out = []
    for d, (_, _, manager) in mesh.decode.items():
        receiver = manager.create_receiver(ADDR, room)
        receiver.init()
        pages, state = destination(d)
        receiver.send_metadata(pages, d, state=state)
        out.append(receiver)
    return out


def send_all(manager: LocalKVManager, states: StatePools, sender: LocalKVSender, room: int) -> None:
    assert drive(manager, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    sender.init(len(SRC_PAGES), 2)
    manager.metadata.write(2, first_token=42, cached_tokens=0, logprob=None, room=room)
    for send in sends(states):
        if send.state:
            sender.send_state(send.state)
        sender.send(list(send.pages), send.last)


def run(mesh: Mesh, room: int = 5) -> list[LocalKVManager]:
    """Send the room from every prefill rank; the ranks that wrote anything."""
    before = {d: snapshot(states) for d, (_, states, _) in mesh.decode.items()}
    ends = receivers(mesh, room)
    senders = [m.create_sender(ADDR, room) for m, _ in mesh.prefill]
    for (m, states), s in zip(mesh.prefill, senders, strict=True):
        send_all(m, states, s, room)
    for (m, _), s in zip(mesh.prefill, senders, strict=True):
        assert drive(m, s, TERMINAL)[-1] == KVPoll.SUCCESS
    for r in ends:
        eventually(lambda r=r: r.poll().terminal, "a receiver to conclude")  # type: ignore[misc]
    assert [r.poll() for r in ends] == [KVPoll.SUCCESS] * len(ends)
    check_landed(mesh.whole, {d: (p, st) for d, (p, st, _) in mesh.decode.items()}, before)
    for end in [*senders, *ends]:
        assert end.quiescent()
        end.clear()
    assert mesh.hub.open_rooms(ADDR) == 0
    return [m for m, _ in mesh.prefill if m.stats().chunks]


@pytest.mark.parametrize(("tp", "td"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_every_state_kind_lands_byte_exact_across_tp(meshes: list[Mesh], tp: int, td: int) -> None:
    meshes.append(make_mesh(tp, td))
    assert len(run(meshes[-1])) == tp


@pytest.mark.parametrize(("tp", "td"), [(2, 1), (1, 2)])
def test_page_major_pools_land_byte_exact_across_tp(meshes: list[Mesh], tp: int, td: int) -> None:
    meshes.append(make_mesh(tp, td, layout=KVLayout.PAGE_MAJOR))
    run(meshes[-1])


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("tp", [1, 2])
def test_two_prefill_stages_send_their_layers_of_every_pool(
        meshes: list[Mesh], tp: int, layout: KVLayout) -> None:
    meshes.append(make_mesh(tp, 1, pp=2, layout=layout))
    assert len(run(meshes[-1])) == 2 * tp


@pytest.mark.parametrize(("tp", "td"), [(2, 1), (1, 2)])
def test_a_replica_that_sends_no_pages_still_sends_its_recurrent_channels(
        meshes: list[Mesh], tp: int, td: int) -> None:
    # One KV head: with TP 2 -> 1 prefill rank 1 holds a replica no one takes; its half of
    # the recurrent state is its own, so it writes that.
    meshes.append(make_mesh(tp, td, heads=1))
    assert len(run(meshes[-1])) == tp


def replica_room(meshes: list[Mesh], room: int,
                 ) -> tuple[Mesh, LocalKVReceiver, list[LocalKVSender]]:
    """A room from prefill TP 2 to decode TP 1 of a one-head model: prefill rank 1 owes the
    decode rank only its recurrent channels."""
    mesh = make_mesh(2, 1, heads=1)
    meshes.append(mesh)
    (receiver,) = receivers(mesh, room)
    return mesh, receiver, [m.create_sender(ADDR, room) for m, _ in mesh.prefill]


def test_the_decode_room_waits_for_the_rank_that_owes_only_state(meshes: list[Mesh]) -> None:
    mesh, receiver, senders = replica_room(meshes, 6)
    (first, first_states), (second, second_states) = mesh.prefill
    send_all(first, first_states, senders[0], 6)
    assert drive(first, senders[0], TERMINAL)[-1] == KVPoll.SUCCESS
    assert receiver.poll() == KVPoll.TRANSFERRING
    send_all(second, second_states, senders[1], 6)
    assert drive(second, senders[1], TERMINAL)[-1] == KVPoll.SUCCESS
    eventually(lambda: receiver.poll() == KVPoll.SUCCESS, "the receiver to conclude")
    for end in [*senders, receiver]:
        end.clear()


def test_an_abort_on_the_rank_that_owes_only_state_fails_every_rank(meshes: list[Mesh]) -> None:
    mesh, receiver, senders = replica_room(meshes, 7)
    (first, first_states), (second, _) = mesh.prefill
    drive(second, senders[1], {KVPoll.WAITING_FOR_INPUT})
    send_all(first, first_states, senders[0], 7)
    senders[1].abort()
    eventually(lambda: receiver.poll() == KVPoll.FAILED, "the receiver to fail")
    assert drive(first, senders[0], TERMINAL)[-1] == KVPoll.FAILED
    for end in [*senders, receiver]:
        eventually(end.quiescent, "every end to go quiescent")
        end.clear()
    assert mesh.hub.open_rooms(ADDR) == 0


def test_a_recurrent_state_of_the_wrong_width_is_refused_naming_both(meshes: list[Mesh]) -> None:
    p = place(0, 1)
    wrong = rank_pools(p, KVLayout.LAYER_MAJOR)
    wrong.recurrent = RecurrentPool.zeros(num_layers=2, num_slots=3, state_size=3)
    mesh = make_mesh(2, 1, decode_pools=wrong)
    meshes.append(mesh)
    receiver = mesh.decode[0][2].create_receiver(ADDR, 8)
    with pytest.raises(KVGeometryError, match="recurrent: 2 regions of 64-byte int64 items vs "
                                              "2 regions of 12-byte float32 items"):
        receiver.init()
