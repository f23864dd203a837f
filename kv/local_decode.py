"""The local transfer backend, decode side: receivers whose pages the prefill worker fills.

A :class:`LocalKVReceiver` is BOOTSTRAPPING until ``init()`` found its prefill manager in the
hub (and checked that both pools share one page geometry), WAITING_FOR_INPUT until
``send_metadata()`` hands that manager a :class:`~kv.local.Link` with the destination pages and
slot, then TRANSFERRING until the prefill worker copied the last chunk and the metadata row
(SUCCESS) or the room failed. From ``send_metadata()`` on the link owns the receiver's state
(see :mod:`kv.local`, the prefill side); a cleared receiver announces nothing more.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

from kv.local import LocalEndpoint, LocalKVManager, LocalTransferHub, check_pages, check_slot
from kv.local_link import Link, Side
from kv.metadata import MetadataBuffers
from kv.pool import KVGeometryError, KVPool
from kv.transfer import KVPoll, accepts_call


class LocalDecodeManager:
    """Decode side: receivers whose pages and metadata rows the prefill worker fills."""

    def __init__(self, pool: KVPool, metadata: MetadataBuffers, *, hub: LocalTransferHub) -> None:
        self.pool = pool
        self.metadata = metadata
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.hub = hub

    def create_receiver(self, bootstrap_addr: str, room: int) -> LocalKVReceiver:
        return LocalKVReceiver(self, bootstrap_addr, room)

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Tell the prefill manager at ``bootstrap_addr`` that this side will never send
        ``room``'s destination (any thread)."""
        with self.hub.lock:
            prefill = self.hub.lookup(bootstrap_addr)
            if prefill is not None:
                prefill.peer_refused(room, reason)

    def close(self) -> None:
        """Nothing to release: the copies run on the prefill manager's worker."""


class LocalKVReceiver(LocalEndpoint):
    def __init__(self, manager: LocalDecodeManager, bootstrap_addr: str, room: int) -> None:
        super().__init__(manager.hub.lock, bootstrap_addr, Side(room, manager.ready, "receiver"))
        self._manager = manager
        self._prefill: LocalKVManager | None = None

    def init(self) -> None:
        """Resolve the prefill peer. Raises :class:`KVGeometryError` when its pool's page
        layout differs from ours (a deployment error: no request could ever transfer)."""
        manager = self._manager
        with self._lock:
            if self._side.status != KVPoll.BOOTSTRAPPING:
                return
            prefill = manager.hub.lookup(self.bootstrap_addr)
            if prefill is None:
                self._side.fail(f"no prefill server at {self.bootstrap_addr!r}")
                return
            mismatches = prefill.pool.geometry.mismatches(manager.pool.geometry)
            if mismatches:
                raise KVGeometryError(
                    f"room {self.room}: the prefill pool at {self.bootstrap_addr!r} and this "
                    f"decode pool differ in {'; '.join(mismatches)} (prefill vs decode); "
                    "configure both sides with the same model and page layout"
                )
            self._prefill = prefill
            self._side.set(KVPoll.WAITING_FOR_INPUT)

    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        dst = [int(p) for p in pages]
        manager = self._manager
        with self._lock:
            prefill = self._prefill
            if not accepts_call(self.room, self._side.status, "send_metadata()",
                                ready=prefill is not None):
                return
            assert prefill is not None
            check_pages(self.room, dst, manager.pool, "decode")
            check_slot(self.room, slot, manager.metadata, "decode")
            self._link = Link(self._side, manager.pool, manager.metadata, dst, slot)
            self._side.set(KVPoll.TRANSFERRING)
            prefill.deliver(self._link)

    def _forget(self) -> None:
        self._side.muted = True
