"""The watching decode sessions of a Mooncake prefill rank (:mod:`kv.mooncake_watch`): kept per
room until their destination comes, taken once when the room fails, remembered as told so a
crossing destination is not answered twice, and bounded by dropping the oldest room."""

from __future__ import annotations

import pytest

from kv.mooncake_watch import Watchers


def test_a_failure_is_owed_once_to_each_watcher_but_those_told_another_way() -> None:
    watchers = Watchers(limit=4)
    for session in ("s1", "s2", "s3"):
        watchers.add(7, session)
    watchers.drop(7, "s3")  # its destination came: the room's legs tell it
    assert watchers.take(7, skip=frozenset({"s2"})) == ["s1"]
    assert watchers.take(7) == []
    assert watchers.rooms() == []


def test_a_session_told_is_remembered_once_per_room() -> None:
    watchers = Watchers(limit=4)
    watchers.add(7, "s1")
    assert not watchers.was_told(7, "s1")
    assert watchers.take(7) == ["s1"]
    assert not watchers.was_told(8, "s1") and not watchers.was_told(7, "s2")
    assert watchers.was_told(7, "s1")
    assert not watchers.was_told(7, "s1")  # a later use of the room number is news again


def test_forgetting_a_room_or_a_session() -> None:
    watchers = Watchers(limit=4)
    watchers.add(1, "s1")
    watchers.add(1, "s2")
    watchers.add(2, "s1")
    watchers.forget_session("s1")
    assert watchers.rooms() == [1]
    watchers.forget(1)
    assert watchers.take(1) == [] and watchers.rooms() == []


def test_the_records_are_bounded_by_dropping_the_oldest_room() -> None:
    watchers = Watchers(limit=2)
    for room in (1, 2, 3):
        watchers.add(room, "s")
    assert watchers.rooms() == [2, 3]
    for room in (2, 3):
        assert watchers.take(room) == ["s"]
    watchers.add(4, "s")
    assert watchers.take(4) == ["s"]
    assert not watchers.was_told(2, "s")  # the oldest told record went first
    assert watchers.was_told(3, "s") and watchers.was_told(4, "s")
    with pytest.raises(ValueError, match="limit"):
        Watchers(limit=0)
