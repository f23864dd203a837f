"""The local transfer backend, decode side: receivers whose pages the prefill workers fill.

A :class:`LocalKVReceiver` is BOOTSTRAPPING until ``init()`` found its prefill server in the hub
(every rank registered, or later when the last one registers; the pools agreeing on everything
but the heads and layers their places give them) and computed its route: the prefill ranks it
contacts and those whose writes complete its room, of every pipeline stage
(:func:`kv.routes.route_places`; with state pools, :func:`kv.state_routes.state_sources`). It
is WAITING_FOR_INPUT until ``send_metadata()`` hands its destination pages and slot to the
room's group (meanwhile it watches the group: a failure that starts on the prefill side fails it
at once), then TRANSFERRING until every source rank wrote its part and the metadata row
landed (SUCCESS) or the room failed. From ``send_metadata()`` on the group owns the
receiver's state (see :mod:`kv.local_room`); a cleared receiver announces nothing more.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence

import attrs

from kv.layouts import LayoutError, SlicePlan, plan_slices
from kv.local import LocalEndpoint, LocalTransferHub, check_pages, check_slot
from kv.local_hub import LocalServer, PrefillRank
from kv.local_room import DECODE, End, ReceiverEnd, RoomGroup, Side, Watcher
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError, KVPool
from kv.rank_table import RankPlace
from kv.routes import IncompatibleRanksError, PrefillRoute, route_places
from kv.state_copy import check_state, state_mismatches
from kv.state_pools import StateKind, StatePools
from kv.state_routes import stage_gaps, state_sources
from kv.transfer import KVPoll, TransferUsageError, accepts_call


class LocalDecodeManager:
    """One decode rank: receivers whose pages and metadata rows the prefill workers fill (and
    with ``states`` the state pools of a hybrid model)."""

    def __init__(self, pool: KVPool, metadata: MetadataBuffers, *, hub: LocalTransferHub,
                 place: RankPlace | None = None, states: StatePools | None = None) -> None:
        self.pool = pool
        self.states = states
        self.metadata = metadata
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.hub = hub
        self.place = place or RankPlace.single(num_layers=pool.num_layers,
                                               kv_heads=pool.kv_heads)
        if (pool.kv_heads, pool.num_layers) != (self.place.heads_per_rank,
                                                len(self.place.layers)):
            raise ValueError(
                f"decode rank {self.place.tp_rank}: its pool holds {pool.kv_heads} heads of "
                f"{pool.num_layers} layers, its place {self.place.heads_per_rank} heads of "
                f"{len(self.place.layers)} layers")

    def create_receiver(self, bootstrap_addr: str, room: int) -> LocalKVReceiver:
        return LocalKVReceiver(self, bootstrap_addr, room)

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Tell the prefill server at ``bootstrap_addr`` that this side will never send
        ``room``'s destination (any thread)."""
        with self.hub.lock:
            server = self.hub.lookup(bootstrap_addr)
            if server is not None:
                for manager in server.managers.values():
                    manager.peer_refused(room, reason)

    def close(self) -> None:
        """Nothing to release: the copies run on the prefill managers' workers."""


class LocalKVReceiver(LocalEndpoint):
    def __init__(self, manager: LocalDecodeManager, bootstrap_addr: str, room: int) -> None:
        super().__init__(manager.hub.lock, bootstrap_addr, Side(room, manager.ready, DECODE))
        self._manager = manager
        self._route: PrefillRoute[PrefillRank] | None = None
        self._end: ReceiverEnd | None = None
        # The group it watches until it sends its destination (kv.local_room's watchers).
        self._watcher: Watcher | None = None
        self._watched: RoomGroup | None = None

    def init(self) -> None:
        """Resolve the prefill ranks; while the prefill server has not registered all of them,
        stay BOOTSTRAPPING until the last one does (the hub resumes the receiver then). Raises
        :class:`KVGeometryError` when a prefill pool's page layout or model differs from ours,
        or no plan serves the two layouts (a deployment error: no request could ever
        transfer); found once the last rank registered, the same error fails the room."""
        with self._lock:
            if self._side.status != KVPoll.BOOTSTRAPPING:
                return
            server = self._manager.hub.lookup(self.bootstrap_addr)
            if server is None:
                self._side.fail(f"no prefill server at {self.bootstrap_addr!r}")
                return
            if not server.complete:
                server.waiting.append(self._resume)
                return
            self._resolve(server)

    def _resume(self, server: LocalServer) -> None:
        """The hub's call (lock held) once ``server`` registered its last rank."""
        if self._side.status != KVPoll.BOOTSTRAPPING or self._side.muted:
            return
        try:
            self._resolve(server)
        except KVGeometryError as exc:
            self._side.fail(str(exc))

    def _resolve(self, server: LocalServer) -> None:
        """Route the room (lock held; ``server`` is complete); a geometry the two servers
        cannot exchange raises :class:`KVGeometryError`, after telling the prefill server that
        this side will never ask for the room's KV (it fails its half at once, invariant 8)."""
        try:
            self._route = self._routed(server)
        except KVGeometryError as exc:
            for prefill in server.managers.values():
                prefill.peer_refused(self.room, str(exc))
            raise
        self._side.set(KVPoll.WAITING_FOR_INPUT)
        self._watcher = Watcher(self._side, frozenset(r.rank for r in self._route.contacts))
        self._watched = server.watch(self._manager.place.tp_rank, self._watcher)

    def _routed(self, server: LocalServer) -> PrefillRoute[PrefillRank]:
        """The room's route, once the pools are checked (lock held)."""
        manager = self._manager
        mine = manager.pool.geometry
        for rank, prefill in sorted(server.managers.items()):
            theirs = attrs.evolve(prefill.pool.geometry, kv_heads=mine.kv_heads,
                                  num_layers=mine.num_layers)
            mismatches = theirs.mismatches(mine)
            if prefill.states is not None or manager.states is not None:
                mismatches += state_mismatches(prefill.states or StatePools(prefill.pool),
                                               manager.states or StatePools(manager.pool),
                                               _plan(prefill.place, manager.place))
            if mismatches:
                where = "" if server.world_size == 1 else f" (rank {rank})"
                raise KVGeometryError(
                    f"room {self.room}: the prefill pool at {self.bootstrap_addr!r}{where} "
                    f"and this decode pool differ in {'; '.join(mismatches)} (prefill vs "
                    "decode); configure both sides with the same model and page layout"
                )
        gaps = [] if manager.states is None else stage_gaps(
            [m.states.stage_layers() for m in server.managers.values()
             if m.states is not None and m.place.tp_rank == 0 and m.place.dp_rank == 0],
            manager.states.stage_layers())
        if gaps:
            raise KVGeometryError(f"room {self.room}: the prefill server at "
                                  f"{self.bootstrap_addr!r}: {'; '.join(gaps)}")
        try:
            return route_places(list(server.managers.values()), manager.place, self.room)
        except IncompatibleRanksError as exc:
            raise KVGeometryError(f"room {self.room}: {exc}") from None

    def send_metadata(self, pages: Sequence[int], slot: int,
                      state: Mapping[StateKind, Sequence[int]] | None = None) -> None:
        """Hand the destination ``pages`` and ``slot`` (and with state pools, where each kind
        of ``state`` goes) to the room's group."""
        dst = [int(p) for p in pages]
        dst_state = {kind: [int(i) for i in items] for kind, items in (state or {}).items()}
        manager = self._manager
        with self._lock:
            route = self._route
            if not accepts_call(self.room, self._side.status, "send_metadata()",
                                ready=route is not None):
                return
            assert route is not None
            check_pages(self.room, dst, manager.pool, "decode")
            check_slot(self.room, slot, manager.metadata, "decode")
            why = check_state(manager.states, dst_state, "decode")
            if why:
                raise TransferUsageError(self.room, why)
            server = manager.hub.lookup(self.bootstrap_addr)
            if server is None:
                self._side.fail(f"the prefill server at {self.bootstrap_addr!r} closed")
                return
            self._unwatch(server)
            last_stage = route.stages[-1]
            wanted = state_sources(route.plan, manager.place.tp_rank,
                                   {} if manager.states is None else manager.states.shapes())
            self._end = ReceiverEnd(
                side=self._side, place=manager.place, pool=manager.pool,
                metadata=manager.metadata, pages=dst, slot=slot,
                contacts=frozenset(r.rank for r in route.contacts),
                sources=frozenset(r.rank for s in route.stages for r in s.contacts
                                  if r.place.tp_rank in wanted),
                row_writer=min(r.rank for r in last_stage.sources),
                states=manager.states, state=dst_state,
            )
            self._group = server.join_receiver(self._end)

    # -- called with the lock held --------------------------------------------------------

    def _joined(self) -> End | None:
        return self._end

    def _forget(self) -> None:
        self._side.muted = True
        server = self._manager.hub.lookup(self.bootstrap_addr)
        if server is not None and self._resume in server.waiting:
            server.waiting.remove(self._resume)
        if server is not None:
            self._unwatch(server)
        if self._group is not None and self._end is not None and server is not None:
            server.leave(self._group, self._end)

    def _unwatch(self, server: LocalServer) -> None:
        if self._watched is not None and self._watcher is not None:
            server.unwatch(self._watched, self._manager.place.tp_rank, self._watcher)
        self._watched = self._watcher = None


def _plan(prefill: RankPlace, decode: RankPlace) -> SlicePlan | None:
    """The slice plan between the two places (None when there is none: the route refuses)."""
    try:
        return plan_slices(prefill.tp_layout, decode.tp_layout)
    except LayoutError:
        return None
