"""The early destinations of a Mooncake prefill rank (:mod:`kv.mooncake_early`): kept per room
in arrival order, bounded by evicting the oldest room, withdrawn per session by an abort."""

from __future__ import annotations

import numpy as np
import pytest

from kv import wire
from kv.mooncake_early import EarlyDestinations


def dest(room: int, session: str) -> wire.Destination:
    return wire.Destination(room, session, np.arange(2, dtype=np.int64), 0)


def test_destinations_wait_for_their_room_in_arrival_order() -> None:
    early = EarlyDestinations(limit=4)
    a, b, c = dest(7, "s1"), dest(8, "s1"), dest(7, "s2")
    for d in (a, b, c):
        early.keep(d)
    assert early.take(7) == [a, c]
    assert early.take(7) == []
    assert early.take(8) == [b]


def test_one_room_too_many_evicts_the_oldest_and_says_which() -> None:
    early = EarlyDestinations(limit=2)
    early.keep(dest(1, "s"))
    early.keep(dest(2, "s"))
    early.keep(dest(2, "t"))  # a second destination of a kept room is no new room
    with pytest.raises(wire.WireError, match="evicted early room 1"):
        early.keep(dest(3, "s"))
    assert early.take(1) == []
    assert [d.room for d in early.take(2) + early.take(3)] == [2, 2, 3]


def test_an_abort_withdraws_only_its_own_sessions_destinations() -> None:
    early = EarlyDestinations(limit=4)
    mine, theirs = dest(5, "s1"), dest(5, "s2")
    early.keep(mine)
    early.keep(theirs)
    assert not early.withdraw(5, "s3")
    assert not early.withdraw(6, "s1")
    assert early.withdraw(5, "s1")
    assert not early.withdraw(5, "s1")
    assert early.take(5) == [theirs]
    early.keep(mine)
    assert early.withdraw(5, "s1")
    assert early.take(5) == []
