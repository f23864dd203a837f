"""Hybrid state between parallel layouts over the Mooncake backend (every rank in this process
with its own transfer engine, over loopback TCP): the draft and SWA pools' head slices, the
recurrent state's channels and the index pages land byte-exact on every decode rank for prefill
TP {1, 2} x decode TP {1, 2}, a one-head GQA replica and prefill PP 2 -> decode PP 1; a decode
room waits for the rank that owes it only state, and fails on every end when that rank
aborts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.pool_layout import KVLayout
from tests import state_layout_harness as h
from tests.transfer_harness import eventually

pytestmark = [pytest.mark.mooncake]


@contextmanager
def servers(tp: int, td: int, *, pp: int = 1, heads: int = 4,
            layout: KVLayout = KVLayout.LAYER_MAJOR) -> Iterator[h.Mesh]:
    """A prefill server of ``tp`` x ``pp`` ranks and a decode server of ``td``, each rank with
    its engine, behind one bootstrap endpoint."""
    server = BootstrapServer(expected_ranks=tp * pp)
    mesh = h.Mesh(server.address, h.whole_model(tp * 10 + td + pp, layout), [], {})
    try:
        for s, t in itertools.product(range(pp), range(tp)):
            p = h.place(t, tp, heads=heads, s=s, pp=pp)
            states = h.rank_pools(p, layout)
            h.fill(states, mesh.whole, p)
            manager = MooncakeKVManager(states.full, MetadataBuffers(4), place=p, states=states)
            mesh.prefill.append((manager, states))
            manager.register_to_bootstrap(server.address)
        for d in range(td):
            p = h.place(d, td, heads=heads)
            states = h.rank_pools(p, layout)
            mesh.decode[d] = (p, states, MooncakeDecodeManager(
                states.full, MetadataBuffers(4), server.address, place=p, states=states))
        yield mesh
    finally:
        for _, _, m in mesh.decode.values():
            m.close()
        for m, _ in mesh.prefill:
            m.close()
        server.close()


@pytest.mark.parametrize(("tp", "td", "layout"), [
    (1, 2, KVLayout.LAYER_MAJOR), (2, 1, KVLayout.PAGE_MAJOR), (2, 2, KVLayout.LAYER_MAJOR)])
def test_every_state_kind_lands_byte_exact_across_tp(tp: int, td: int, layout: KVLayout) -> None:
    with servers(tp, td, layout=layout) as mesh:
        h.run_room(mesh)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_two_prefill_stages_send_their_layers_of_every_pool(layout: KVLayout) -> None:
    with servers(2, 1, pp=2, layout=layout) as mesh:
        h.run_room(mesh)


def test_the_decode_room_waits_for_the_rank_that_owes_only_state() -> None:
    with servers(2, 1, heads=1) as mesh:
        h.wait_for_the_state_only_rank(mesh, 6)


def test_an_abort_on_the_rank_that_owes_only_state_fails_every_rank() -> None:
    with servers(2, 1, heads=1) as mesh:
        for end in (e for group in h.abort_the_state_only_rank(mesh, 7) for e in group):
            eventually(end.quiescent, "every end to go quiescent")
            end.clear()
        managers = [m for m, _ in mesh.prefill] + [m for _, _, m in mesh.decode.values()]
        assert [m.live_rooms() for m in managers] == [0] * len(managers)
