"""A Mooncake decode rank refuses a prefill server on another host when either side's transfer
engine and control sockets listen on loopback, where the other host cannot reach them (a
worker started with ``--host 0.0.0.0`` and the default ``--mooncake-host``): the request fails
at once naming the flag, instead of both halves waiting out their timeouts."""

from __future__ import annotations

import pytest

from kv.mooncake_engine import IncompatiblePeerError
from kv.mooncake_peers import check_reachable
from kv.rank_table import PrefillInfo, RankInfo, RankPlace

# A documentation address (RFC 5737): never one of this host's.
ELSEWHERE = "192.0.2.1"


def table(host: str) -> PrefillInfo:
    ranks = tuple(
        RankInfo(rank=r, endpoint=f"tcp://{host}:{7000 + r}", session=f"{host}:{8000 + r}",
                 page_size=16, kv_dtype="float32", kv_layout="layer_major", head_dim=8,
                 place=RankPlace(tp_rank=r, tp_size=2, kv_heads=2, num_layers=2,
                                 layer_start=0, layer_stop=2))
        for r in range(2))
    return PrefillInfo(page_size=16, kv_dtype="float32", ranks=ranks)


def test_a_prefill_elsewhere_whose_ranks_listen_on_loopback_is_refused() -> None:
    with pytest.raises(IncompatiblePeerError) as err:
        check_reachable(f"{ELSEWHERE}:8998", table("127.0.0.1"), "192.0.2.2")
    assert str(err.value) == (
        f"prefill at {ELSEWHERE}:8998 is on another host, but its rank 0 listens on 127.0.0.1 "
        "(loopback), which this host cannot reach: start the prefill with --mooncake-host set "
        "to its address on the network (MooncakeConfig.hostname in a library)")


@pytest.mark.parametrize("mine", ["127.0.0.1", "localhost", "::1"])
def test_a_decode_on_loopback_refuses_a_prefill_elsewhere(mine: str) -> None:
    with pytest.raises(IncompatiblePeerError) as err:
        check_reachable(f"{ELSEWHERE}:8998", table(ELSEWHERE), mine)
    assert f"this decode's transfer engine and control sockets listen on {mine} (loopback)" \
        in str(err.value)
    assert str(err.value).endswith("start this decode with --mooncake-host set to its address "
                                   "on the network (MooncakeConfig.hostname in a library)")


@pytest.mark.parametrize(("bootstrap", "ranks", "mine"), [
    ("127.0.0.1:8998", "127.0.0.1", "127.0.0.1"),   # one host, on loopback
    ("localhost:8998", "127.0.0.1", "127.0.0.1"),
    ("0.0.0.0:8998", "127.0.0.1", "127.0.0.1"),     # an address this host binds: this host
    (f"{ELSEWHERE}:8998", ELSEWHERE, "192.0.2.2"),  # two hosts, on the network
], ids=["loopback", "localhost", "this-host", "network"])
def test_what_each_side_can_reach_passes(bootstrap: str, ranks: str, mine: str) -> None:
    check_reachable(bootstrap, table(ranks), mine)
