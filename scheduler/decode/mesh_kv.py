"""The KV manager a decode peer on a TP mesh talks to: every rank's receivers agree before the
peer acts on them.

Theory of operation
-------------------
Each decode rank of a TP group has its own KV manager and a receiver per room (its head slice
of the room's KV comes from the prefill ranks that write into it, :mod:`kv.routes`). The
peer's transitions must be the same on every rank and pass, since its decode steps are
collectives; but a rank's receiver changes state when its own bytes land. :class:`MeshDecodeKV`
wraps the rank's manager so that the peer (:class:`scheduler.decode.peer.DecodePeer`,
unchanged) only ever sees agreed values:

- **polls**: once per pass (:meth:`MeshDecodeKV.agree`, before the peer's pass) the ranks
  agree on the rooms to look at (the union of the rooms each rank's manager pushed, as the
  prefill side's :class:`scheduler.dist.ranks.TorchRanks`) and take the MIN of their local
  polls. A room is SUCCESS only when every rank's receiver reports SUCCESS *and* its metadata
  row carries the room (a rank whose row has not landed counts TRANSFERRING); any rank's
  FAILED fails the room on all, and a refusal by the prefill seen on one rank is the reason
  on every rank (each vote is twice the poll, plus one unless the room was refused there).
  The agreed value is what :meth:`MeshReceiver.poll` answers
  until the next agreement, and the agreed rooms go on this manager's ``ready`` queue.
- **failures at the start**: a receiver that cannot be created or initialised on one rank
  does not fail the request there at once (which would diverge the ranks) but reports FAILED
  to the next agreement.
- **quiescence**: the peer frees a finished request's pages and slot once its receiver is
  quiescent (:class:`kv.release.Releaser`); a rank's receiver may go quiescent passes before
  another's, and the ranks' allocators would diverge. So quiescence is agreed too (the MIN,
  for the receivers that ended: aborted, or agreed terminal), and every rank frees on the same
  pass. With the same frees in the same order, every rank's allocators give the same answers.
- **refusals** go to the prefill from the first rank only (one refusal per room).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence

from kv.metadata import MetadataBuffers, MetadataError
from kv.transfer import (
    REASON_OTHER_RANK,
    DecodeKVManager,
    KVPoll,
    KVReceiver,
    TransferError,
    refusal,
)
from scheduler.dist.ranks import RankSync
from scheduler.messages import take_all

logger = logging.getLogger(__name__)

# Votes (see :meth:`MeshReceiver.local_vote`): a room every rank finished, one a rank refused.
_SUCCESS = 2 * int(KVPoll.SUCCESS) + 1
_REFUSED = 2 * int(KVPoll.FAILED)


class MeshReceiver:
    """One rank's end of a room, answering what the decode TP group agreed (see the module)."""

    def __init__(
        self, mgr: MeshDecodeKV, room: int, inner: KVReceiver | None, error: TransferError | None
    ) -> None:
        self._mgr = mgr
        self.room = room
        self.inner = inner
        self.error = error  # a failure of this rank the inner receiver does not report
        self.agreed = KVPoll.BOOTSTRAPPING  # until the TP group agrees otherwise
        self.agreed_quiescent = False
        self.aborted = False
        self.slot = -1

    def init(self) -> None:
        if self.inner is None or self.error is not None:
            return
        try:
            self.inner.init()
        except Exception as exc:  # told to every rank by the next agreement
            logger.warning("room %d: bootstrap failed on this decode rank: %s", self.room, exc)
            self.error = TransferError(self.room, f"bootstrap failed: {exc}")

    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        self.slot = slot
        if self.inner is not None:
            self.inner.send_metadata(pages, slot)

    def poll(self) -> KVPoll:
        return self.agreed

    def failure_exception(self) -> TransferError:
        if self.error is not None:
            return self.error
        assert self.inner is not None  # a receiver without one carries its error
        return self.inner.failure_exception()

    def abort(self) -> None:
        self.aborted = True
        if self.inner is not None:
            self.inner.abort()
        self._mgr._ended(self)

    def clear(self) -> None:
        if self.inner is not None:
            self.inner.clear()
        self._mgr._cleared(self)

    def quiescent(self) -> bool:
        return self.agreed_quiescent

    @property
    def ended(self) -> bool:
        """Whether the peer may release this room (so its quiescence must be agreed)."""
        return self.aborted or self.agreed.terminal

    def local_vote(self, metadata: MetadataBuffers) -> int:
        """This rank's vote for the MIN: twice its poll, plus one unless the prefill refused
        the room here (so a refusal seen by any rank is what every rank reports)."""
        poll = self._local_poll(metadata)
        refused = poll == KVPoll.FAILED and self.local_refused()
        return 2 * int(poll) + (0 if refused else 1)

    def local_refused(self) -> bool:
        return self.failure_exception().refused

    def _local_poll(self, metadata: MetadataBuffers) -> KVPoll:
        """This rank's poll, with the metadata gate (SUCCESS only once the row landed)."""
        if self.error is not None or self.inner is None:
            return KVPoll.FAILED
        poll = self.inner.poll()
        if poll != KVPoll.SUCCESS or self.room == 0:
            return poll
        try:
            landed = metadata.read(self.slot, expected_room=self.room)
        except MetadataError as exc:
            self.error = TransferError(self.room, str(exc))
            return KVPoll.FAILED
        if landed is None:
            # Nothing pushes the room when the row lands: look again on the next agreement.
            self._mgr._changed.add(self.room)
            return KVPoll.TRANSFERRING
        return KVPoll.SUCCESS

    def local_quiescent(self) -> bool:
        return self.inner is None or self.inner.quiescent()


class MeshDecodeKV:
    """A decode rank's manager (``inner``) behind the agreement of its TP group (``ranks``);
    ``first``: the rank that tells the prefill of refusals."""

    def __init__(
        self, inner: DecodeKVManager, metadata: MetadataBuffers, ranks: RankSync, *, first: bool
    ) -> None:
        self.inner = inner
        self.metadata = metadata
        self.ranks = ranks
        self.first = first
        self._ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._live: dict[int, MeshReceiver] = {}
        # Rooms to poll on the next agreement though the inner manager did not push them: a
        # receiver that failed here without it, a row that has not landed yet.
        self._changed: set[int] = set()
        self._ending: dict[int, MeshReceiver] = {}

    @property
    def ready(self) -> queue.SimpleQueue[int]:
        return self._ready

    def create_receiver(self, bootstrap_addr: str, room: int) -> MeshReceiver:
        inner: KVReceiver | None = None
        error: TransferError | None = None
        try:
            inner = self.inner.create_receiver(bootstrap_addr, room)
        except Exception as exc:  # told to every rank by the next agreement
            logger.warning("room %d: no receiver on this decode rank: %s", room, exc)
            error = TransferError(room, f"bootstrap failed: {exc}")
        receiver = MeshReceiver(self, room, inner, error)
        self._live[room] = receiver
        self._changed.add(room)
        return receiver

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        if self.first:
            self.inner.refuse(bootstrap_addr, room, reason)

    def close(self) -> None:
        self.inner.close()

    def live_rooms(self) -> int:
        """Rooms with a receiver not cleared yet."""
        return len(self._live)

    def agree(self) -> None:
        """The pass's agreement (a collective of the TP group: every rank calls it once per
        pass, before the peer's pass)."""
        pushed = set(take_all(self.inner.ready)) | self._changed
        self._changed = set()
        rooms = self.ranks.agree_keys(sorted(pushed))
        mine = [self._live.get(room) for room in rooms]
        local = [_SUCCESS if r is None else r.local_vote(self.metadata) for r in mine]
        for room, receiver, vote in zip(rooms, mine, self.ranks.min_reduce(local), strict=True):
            if receiver is None:
                continue  # cleared here and everywhere (clears are agreed): a late push
            receiver.agreed = KVPoll(vote // 2)
            if vote == _REFUSED and receiver.error is None and not receiver.local_refused():
                receiver.error = TransferError(room, refusal(REASON_OTHER_RANK))
            if receiver.ended:
                self._ending[room] = receiver
            self._ready.put(room)
        ending = [self._ending[room] for room in sorted(self._ending)]
        quiet = self.ranks.min_reduce([int(r.local_quiescent()) for r in ending])
        for receiver, flag in zip(ending, quiet, strict=True):
            if flag:
                receiver.agreed_quiescent = True
                del self._ending[receiver.room]

    def _ended(self, receiver: MeshReceiver) -> None:
        if not receiver.agreed_quiescent:
            self._ending[receiver.room] = receiver

    def _cleared(self, receiver: MeshReceiver) -> None:
        if self._live.get(receiver.room) is receiver:
            del self._live[receiver.room]
        self._ending.pop(receiver.room, None)
