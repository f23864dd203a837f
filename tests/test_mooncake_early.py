"""The early destinations of a Mooncake prefill rank (:mod:`kv.mooncake_early`): kept per room
in arrival order, bounded by evicting the oldest room (whose destinations its owner answers),
withdrawn per session by an abort or as the session leaves."""

from __future__ import annotations

import numpy as np

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


def test_one_room_too_many_evicts_the_oldest_and_returns_its_destinations() -> None:
    early = EarlyDestinations(limit=2)
    first, second = dest(1, "s"), dest(1, "t")
    assert early.keep(first) == [] and early.keep(second) == []
    assert early.keep(dest(2, "s")) == []
    assert early.keep(dest(2, "t")) == []  # a second destination of a kept room is no new room
    assert early.keep(dest(3, "s")) == [first, second]
    assert early.take(1) == []
    assert [d.room for d in early.take(2) + early.take(3)] == [2, 2, 3]


def test_what_a_session_holds_and_withdraws_when_it_leaves() -> None:
    early = EarlyDestinations(limit=4)
    mine, theirs, later = dest(5, "s1"), dest(5, "s2"), dest(6, "s1")
    for d in (mine, theirs, later):
        early.keep(d)
    assert early.holds(5, "s1") and early.holds(6, "s1") and not early.holds(6, "s2")
    assert early.withdraw_session("s1") == [mine, later]
    assert not early.holds(5, "s1") and early.take(5) == [theirs] and early.take(6) == []


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
