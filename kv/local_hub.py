"""Where the local backend's decode receivers find prefill ranks: the hub, and per bootstrap
address a :class:`LocalServer` holding that server's ranks and its rooms' current groups.

A prefill manager registers under its server's bootstrap address with its place
(:class:`~kv.rank_table.RankPlace`); a registration that disagrees with the ranks already there
is refused as the bootstrap endpoint refuses it (:func:`kv.rank_table.registration_conflict`),
and so is a pool that does not hold what its place says. A server is complete once every rank
of its mesh registered; a decode receiver that looked it up before waits in
:attr:`LocalServer.waiting` and resumes when the last rank registers. The groups
(:class:`~kv.local_room.RoomGroup`) live here so that every rank's ends of a room find the
same one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from kv.local_room import DECODE, PREFILL, Failure, ReceiverEnd, RoomGroup, SenderEnd, Watcher
from kv.pool import KVPool
from kv.rank_table import RankInfo, RankPlace, registration_conflict
from kv.refusal import RefusedRooms
from kv.state_pools import StatePools
from kv.transfer import REASON_PEER_REFUSED, KVPoll, refusal

#: How a local rank fills the fields of a registration that only the network needs.
_IN_PROCESS = "tcp://in-process"


class PrefillRank(Protocol):
    """What the server needs of a prefill manager."""

    pool: KVPool
    states: StatePools | None  # a hybrid model's state pools (kv/state_pools.py)
    refused: RefusedRooms  # rooms this rank will not serve
    peer_refused_rooms: RefusedRooms  # rooms the decode side will not ask for

    @property
    def rank(self) -> int: ...

    @property
    def place(self) -> RankPlace: ...

    def peer_refused(self, room: int, reason: str) -> None: ...


def _registration(manager: PrefillRank, addr: str) -> RankInfo:
    """The rank as the bootstrap endpoint would see it. In one process a pool may hold any
    torch dtype, not only the wire's: :meth:`LocalServer.add` compares dtypes itself."""
    pool = manager.pool
    return RankInfo(rank=manager.rank, endpoint=_IN_PROCESS, session=addr,
                    page_size=pool.page_size, kv_dtype="float32", model=pool.model,
                    kv_layout=pool.layout.value, head_dim=pool.head_dim, place=manager.place)


class LocalServer:
    """One prefill server's ranks and its rooms (guarded by the hub's lock)."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.managers: dict[int, PrefillRank] = {}
        self.groups: dict[int, RoomGroup] = {}  # room -> its current group
        # Decode receivers waiting for the missing ranks: called (lock held) with this server
        # once the last one registered.
        self.waiting: list[Callable[[LocalServer], None]] = []

    @property
    def world_size(self) -> int:
        return next(iter(self.managers.values())).place.world_size if self.managers else 0

    @property
    def complete(self) -> bool:
        return bool(self.managers) and len(self.managers) == self.world_size

    def add(self, manager: PrefillRank) -> None:
        pool, place = manager.pool, manager.place
        if (pool.kv_heads, pool.num_layers) != (place.heads_per_rank, len(place.layers)):
            raise ValueError(
                f"prefill rank {manager.rank} at {self.addr!r}: its pool holds "
                f"{pool.kv_heads} heads of {pool.num_layers} layers, its place "
                f"{place.heads_per_rank} heads of {len(place.layers)} layers")
        if manager.rank in self.managers:
            raise ValueError(f"a prefill manager is already registered at {self.addr!r} as "
                             f"rank {manager.rank}")
        registered = {r: _registration(m, self.addr) for r, m in self.managers.items()}
        problem = registration_conflict(_registration(manager, self.addr), registered,
                                        place.world_size)
        geometry = [m.pool.geometry for m in self.managers.values()]
        if problem is None and geometry and geometry[0].dtype != pool.dtype:
            problem = (f"rank {manager.rank} has dtype {pool.dtype} but rank "
                       f"{next(iter(self.managers))} has {geometry[0].dtype}")
        if problem is not None:
            raise ValueError(f"prefill at {self.addr!r} refused a registration: {problem}")
        self.managers[manager.rank] = manager

    # -- rooms -----------------------------------------------------------------------------

    def group(self, room: int, decode_rank: int | None = None) -> RoomGroup:
        """The room's current group; a new one when there is none, or when a sender already
        paired with ``decode_rank``'s receiver of the current one (a later use of the room)."""
        group = self.groups.get(room)
        if group is None or (decode_rank is not None and decode_rank in group.taken_ranks):
            if group is not None:
                self.retire(group)
            group = self.groups[room] = RoomGroup(room)
        return group

    def retire(self, group: RoomGroup) -> None:
        """Later ends of ``group``'s room form a new group; its members stay with it."""
        group.retired = True
        if self.groups.get(group.room) is group:
            del self.groups[group.room]

    def join_sender(self, manager: PrefillRank, end: SenderEnd) -> RoomGroup:
        group = self.group(end.side.room)
        group.join_sender(end)
        refused = manager.peer_refused_rooms.pop(end.side.room)
        if refused is not None:
            group.fail(Failure.everywhere(DECODE, refusal(refused)))
        return group

    def join_receiver(self, end: ReceiverEnd) -> RoomGroup:
        group = self.group(end.side.room, end.place.tp_rank)
        group.join_receiver(end)
        self._fail_if_refused(group, end.contacts)
        return group

    def watch(self, tp_rank: int, watcher: Watcher) -> RoomGroup:
        """``watcher`` holds its room and waits for pages: the group it watches."""
        group = self.group(watcher.side.room, tp_rank)
        group.watch(tp_rank, watcher)
        self._fail_if_refused(group, watcher.contacts)
        return group

    def unwatch(self, group: RoomGroup, tp_rank: int, watcher: Watcher) -> None:
        group.unwatch(tp_rank, watcher)
        if group.empty and self.groups.get(group.room) is group:
            del self.groups[group.room]

    def _fail_if_refused(self, group: RoomGroup, contacts: frozenset[int]) -> None:
        """Fail ``group`` if a prefill rank of ``contacts`` without a sender in it refused
        the room or is gone."""
        for rank in sorted(contacts - set(group.senders)):
            manager = self.managers.get(rank)
            why = (f"prefill rank {rank} closed" if manager is None
                   else manager.refused.get(group.room))
            if why is not None:
                group.fail(Failure.everywhere(PREFILL, refusal(why)))
                return

    def leave(self, group: RoomGroup, end: SenderEnd | ReceiverEnd,
              manager: PrefillRank | None = None) -> None:
        """``end`` was cleared. A sender retires its group; a group without members is
        forgotten, and a failure nobody took yet is kept as a refusal."""
        room = group.room
        if isinstance(end, SenderEnd):
            if group.senders.get(end.rank) is end:
                del group.senders[end.rank]
            self.retire(group)
            reason = end.side.reason
            if manager is not None and not end.dests and end.side.status == KVPoll.FAILED \
                    and not reason.startswith(REASON_PEER_REFUSED):
                # A late destination gets the refusal.
                manager.refused.add(room, end.told or reason)
        elif group.receivers.get(end.place.tp_rank) is end:
            del group.receivers[end.place.tp_rank]
            failure = group.failure
            if group.empty and failure is not None and failure.origin == DECODE \
                    and not group.retired:
                for rank in end.contacts & set(self.managers):
                    self.managers[rank].peer_refused_rooms.add(room, failure.peer)
        if group.empty and self.groups.get(room) is group:
            del self.groups[room]


class LocalTransferHub:
    """Where local decode receivers find prefill servers by bootstrap address."""

    def __init__(self) -> None:
        # One lock for both sides: a room's state is shared by its senders and receivers.
        self.lock = threading.Lock()
        self._servers: dict[str, LocalServer] = {}

    def register(self, addr: str, manager: PrefillRank) -> None:
        """Add a prefill rank to the server at ``addr``; ValueError naming both ranks' values
        when it disagrees with the ranks already there."""
        with self.lock:
            server = self._servers.get(addr) or LocalServer(addr)
            server.add(manager)
            self._servers[addr] = server
            if server.complete:
                waiting, server.waiting = server.waiting, []
                for resume in waiting:
                    resume(server)

    def unregister(self, addr: str, manager: PrefillRank) -> None:
        with self.lock:
            server = self._servers.get(addr)
            if server is not None and server.managers.get(manager.rank) is manager:
                del server.managers[manager.rank]
                if not server.managers:
                    del self._servers[addr]

    def lookup(self, addr: str) -> LocalServer | None:
        """The prefill server at ``addr``; the caller holds :attr:`lock`."""
        return self._servers.get(addr)

    def open_rooms(self, addr: str) -> int:
        """Groups the server at ``addr`` still keeps (a leak check: 0 once every end of every
        room was cleared)."""
        with self.lock:
            server = self._servers.get(addr)
            return 0 if server is None else len(server.groups)
