"""Hybrid state between parallel layouts over the local backend (every rank in one process):
the draft and SWA pools' head slices, the recurrent state's channels and the index pages land
byte-exact on every decode rank for prefill TP {1, 2} x decode TP {1, 2}, GQA replicas and
prefill PP 2 -> decode PP 1; a decode rank waits for every prefill rank that owes it state; a
failure on one rank fails all; pools a layout cannot serve are refused naming both values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError
from kv.pool_layout import KVLayout
from kv.state_pools import RecurrentPool, StatePools
from tests import state_layout_harness as h
from tests.transfer_harness import eventually

ADDR = "local:state-layouts"
_MANAGERS: dict[int, list[LocalKVManager]] = {}  # by hub: the prefill managers to close


def make_mesh(hub: LocalTransferHub, tp: int, td: int, *, pp: int = 1, heads: int = 4,
              layout: KVLayout = KVLayout.LAYER_MAJOR,
              decode_pools: StatePools | None = None) -> h.Mesh:
    mesh = h.Mesh(ADDR, h.whole_model(tp * 10 + td + pp, layout), [], {})
    for s in range(pp):
        for t in range(tp):
            p = h.place(t, tp, heads=heads, s=s, pp=pp)
            states = h.rank_pools(p, layout)
            h.fill(states, mesh.whole, p)
            manager = LocalKVManager(states.full, MetadataBuffers(4), hub=hub,
                                     bootstrap_addr=ADDR, place=p, states=states)
            _MANAGERS.setdefault(id(hub), []).append(manager)
            mesh.prefill.append((manager, states))
    for d in range(td):
        p = h.place(d, td, heads=heads)
        states = decode_pools or h.rank_pools(p, layout)
        mesh.decode[d] = (p, states, LocalDecodeManager(states.full, MetadataBuffers(4), hub=hub,
                                                        place=p, states=states))
    return mesh


@pytest.fixture
def hub() -> Iterator[LocalTransferHub]:
    """A hub whose prefill managers are closed after the test."""
    hub = LocalTransferHub()
    yield hub
    for manager in _MANAGERS.pop(id(hub), []):
        manager.close()


def cleared(hub: LocalTransferHub, *ends: list[Any]) -> None:
    """Clear every end once quiescent; no record of a room may be left."""
    for end in (e for group in ends for e in group):
        eventually(end.quiescent, "every end to go quiescent")
        end.clear()
    assert hub.open_rooms(ADDR) == 0


def writers(mesh: h.Mesh) -> int:
    return sum(1 for m, _ in mesh.prefill if m.stats().chunks)


@pytest.mark.parametrize(("tp", "td"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_every_state_kind_lands_byte_exact_across_tp(hub: LocalTransferHub, tp: int,
                                                      td: int) -> None:
    mesh = make_mesh(hub, tp, td)
    cleared(hub, *h.run_room(mesh))
    assert writers(mesh) == tp


@pytest.mark.parametrize(("tp", "td"), [(2, 1), (1, 2)])
def test_page_major_pools_land_byte_exact_across_tp(hub: LocalTransferHub, tp: int,
                                                    td: int) -> None:
    cleared(hub, *h.run_room(make_mesh(hub, tp, td, layout=KVLayout.PAGE_MAJOR)))


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("tp", [1, 2])
def test_two_prefill_stages_send_their_layers_of_every_pool(
        hub: LocalTransferHub, tp: int, layout: KVLayout) -> None:
    mesh = make_mesh(hub, tp, 1, pp=2, layout=layout)
    cleared(hub, *h.run_room(mesh))
    assert writers(mesh) == 2 * tp


@pytest.mark.parametrize(("tp", "td"), [(2, 1), (1, 2)])
def test_a_replica_that_sends_no_pages_still_sends_its_recurrent_channels(
        hub: LocalTransferHub, tp: int, td: int) -> None:
    # One KV head: with TP 2 -> 1 prefill rank 1 holds a replica no one takes; its half of
    # the recurrent state is its own, so it writes that.
    mesh = make_mesh(hub, tp, td, heads=1)
    cleared(hub, *h.run_room(mesh))
    assert writers(mesh) == tp


def test_the_decode_room_waits_for_the_rank_that_owes_only_state(hub: LocalTransferHub) -> None:
    cleared(hub, *h.wait_for_the_state_only_rank(make_mesh(hub, 2, 1, heads=1), 6))


def test_an_abort_on_the_rank_that_owes_only_state_fails_every_rank(
        hub: LocalTransferHub) -> None:
    cleared(hub, *h.abort_the_state_only_rank(make_mesh(hub, 2, 1, heads=1), 7))


def test_a_recurrent_state_of_the_wrong_width_is_refused_naming_both(
        hub: LocalTransferHub) -> None:
    wrong = h.rank_pools(h.place(0, 1), KVLayout.LAYER_MAJOR)
    wrong.recurrent = RecurrentPool.zeros(num_layers=2, num_slots=3, state_size=3)
    mesh = make_mesh(hub, 2, 1, decode_pools=wrong)
    receiver = mesh.decode[0][2].create_receiver(ADDR, 8)
    with pytest.raises(KVGeometryError, match="recurrent: 2 regions of 64-byte int64 items vs "
                                              "2 regions of 12-byte float32 items"):
        receiver.init()
