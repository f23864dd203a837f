"""The records of a Mooncake prefill rank's room table (:mod:`kv.mooncake_rooms`): a room, the
legs it writes (one per decode rank whose destination it waits for), the chunks its sender
queues, and the statuses owed to decode. Plain records: the room table changes them under its
lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from kv import wire
from kv.mooncake_slices import Target
from kv.state_pools import StateKind
from kv.transfer import KVPoll, SendCursor


@attrs.frozen
class Owed:
    """A ``Status`` owed to decode session ``session`` for ``room``."""

    session: str
    room: int
    poll: KVPoll
    reason: str = ""


@attrs.frozen(eq=False)
class Leg:
    """One decode rank's destination for a room, and what this rank writes into it."""

    dest: wire.Destination
    target: Target

    @property
    def session(self) -> str:
        return self.dest.session


@attrs.define(eq=False)
class PrefillRoom:
    room: int
    created: float
    status: KVPoll = KVPoll.BOOTSTRAPPING
    reason: str = ""
    # What decode is told of the failure instead, as a refusal: a reason its client is to see
    # (MooncakeKVSender.abort's ``why``).
    told: str = ""
    timed_out: bool = False
    # The destinations that came, by decode rank, and the decode ranks the room waits for
    # (known with the first destination: they follow from the decode side's TP size).
    legs: dict[int, Leg] = attrs.Factory(dict)
    waits_for: tuple[int, ...] | None = None
    cursor: SendCursor = attrs.field(init=False)
    in_flight: int = 0
    # The decode ranks whose last chunk was written.
    written: set[int] = attrs.Factory(set)
    # Decode was told of the failure, after the room went quiescent (see PrefillRooms._settle).
    notified: bool = False
    # The last chunk's state items by kind (MooncakeKVSender.send_state).
    state: dict[StateKind, list[int]] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self.cursor = SendCursor(self.room)

    @property
    def paired(self) -> bool:
        """Every destination the room waits for came."""
        return self.waits_for is not None and len(self.legs) == len(self.waits_for)

    @property
    def writers(self) -> list[Leg]:
        """The legs this rank writes into, pages or state (none when it is status-only)."""
        return [leg for leg in self.legs.values()
                if leg.target.slices or leg.target.state.shares]

    @property
    def sessions(self) -> str:
        return ", ".join(leg.session for leg in self.legs.values())


@attrs.frozen(eq=False)
class Chunk:
    """Pages of one room to write into one decode rank: source pages here, destination pages
    there (the draft pool's copies of them too); a last chunk's state items by kind here, and
    there those its destination names."""

    rec: PrefillRoom
    leg: Leg
    src: Sequence[int]
    dst: np.ndarray
    last: bool
    state: Mapping[StateKind, Sequence[int]] = attrs.field(factory=dict)

    @property
    def session(self) -> str:
        return self.leg.session
