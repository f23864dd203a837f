"""The decode peer on several tensor-parallel ranks: the same requests, the same steps.

Theory of operation
-------------------
A decode server at TP ``T`` runs one model over ``T`` ranks
(:class:`scheduler.model.sharded.ShardedLlama`: each rank holds its query and KV heads and its
MLP rows; every decode step is a collective). Every rank runs its own
:class:`~scheduler.decode.peer.DecodePeer` over its shard, its own pool (its KV heads) and its
own KV manager, which receives its head slice of each room from the prefill ranks that write
into it (:mod:`kv.routes`). The peers stay in lockstep, taking the same transitions and
forming the same decode batches on every pass, through three agreements per pass, all on one
gloo group of the decode ranks (beside the model's groups), in this order:

- **the inbox relay** (:class:`scheduler.dist.relay.InboxRelay`): the first rank (TP rank 0,
  behind the HTTP front) takes requests and aborts, broadcasts what arrived, and every rank
  submits exactly that list to its peer, as on the prefill side;
- **the clock**: the first rank's clock is broadcast, and every peer reads that value for the
  whole pass, so admission times and the waiting deadline expire on the same pass everywhere;
- **the receivers** (:class:`scheduler.decode.mesh_kv.MeshDecodeKV`): the MIN of the ranks'
  polls for the rooms any rank's manager pushed, and the MIN of their quiescence. A request
  is DECODING only when every rank's receiver reports SUCCESS and its metadata row landed;
  a failure on any rank fails it on all; its pages and slot are freed on the same pass on
  every rank.

With the same requests, the same polls, the same clock and the same frees, every peer's
allocators, lifecycle and batches stay the same; the model's logits are broadcast, so every
rank samples the same tokens. Only the first rank's answers go to a client (every rank's are
the same). Speculative decoding and hybrid state pools are not supported on a mesh.

Building the groups is a collective of the whole default group, so every rank of it calls
:func:`build_decode_mesh`, member or not, with the same arguments.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from kv.metadata import MetadataBuffers
from kv.rank_table import RankPlace
from kv.transfer import DecodeKVManager
from scheduler.decode.mesh_kv import MeshDecodeKV
from scheduler.decode.peer import DecodePeer
from scheduler.dist.gather import min_reduce
from scheduler.dist.ranks import TorchRanks
from scheduler.dist.relay import InboxRelay, Item
from scheduler.messages import AbortRequest, NewRequest, take_all
from scheduler.model.sharded import Mesh, build_mesh


@attrs.frozen(eq=False)
class DecodeMeshControl:
    """One decode rank's place in its TP group and the group its agreements run over."""

    mesh: Mesh
    group: Any
    relay: InboxRelay
    ranks: TorchRanks

    @property
    def first(self) -> bool:
        """Whether this rank takes the requests (and answers them)."""
        return self.relay.rank == self.relay.src

    def rank_place(self, *, num_layers: int, kv_heads: int) -> RankPlace:
        """This rank's place, as its KV manager registers it (a decode rank holds every
        layer). Keywords only, as the prefill mesh's: both are ints, easily swapped."""
        return RankPlace(
            tp_rank=self.mesh.tp_rank,
            tp_size=self.mesh.tp_size,
            kv_heads=kv_heads,
            num_layers=num_layers,
            layer_start=0,
            layer_stop=num_layers,
        )

    def share_clock(self, now: float) -> float:
        """The first rank's ``now`` on every rank (a collective)."""
        value = torch.tensor([now], dtype=torch.float64)
        dist.broadcast(value, src=self.relay.src, group=self.group)
        return float(value.item())

    def all_agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on every rank (a collective)."""
        return bool(min_reduce([int(flag)], self.group)[0])


def build_decode_mesh(
    tp_size: int, ranks: Sequence[int], timeout: timedelta | None = None
) -> DecodeMeshControl | None:
    """The decode TP group of ``ranks`` (ascending global ranks; TP rank ``t`` is
    ``ranks[t]``): the model's groups and the agreements' group; None on a rank not in it.
    ``timeout`` bounds one agreement (default: the default group's)."""
    members = tuple(ranks)
    if list(members) != sorted(set(members)):
        raise ValueError(f"the decode ranks must ascend, got {members}")
    mesh = build_mesh(tp_size, 1, members)
    group = dist.new_group(list(members), timeout=timeout)
    if mesh is None:
        return None
    return DecodeMeshControl(
        mesh=mesh, group=group, relay=InboxRelay(group, src=members[0]), ranks=TorchRanks(group)
    )


class MeshDecodePeer(DecodePeer):
    """A :class:`~scheduler.decode.peer.DecodePeer` on one rank of a decode TP group (see the
    module). :meth:`submit` and :meth:`abort` only on the first rank (thread-safe); every rank
    calls :meth:`step` in a loop (a collective)."""

    def __init__(
        self,
        control: DecodeMeshControl,
        *,
        kv: DecodeKVManager,
        metadata: MetadataBuffers,
        clock: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        """``kv``: this rank's KV manager; ``clock``: the first rank's is every rank's.
        ``options``: the other keyword arguments of
        :class:`~scheduler.decode.peer.DecodePeer` (not ``speculative`` or ``states``: not
        supported on a mesh)."""
        for name in ("speculative", "states"):
            if options.get(name) is not None:
                raise ValueError(f"MeshDecodePeer: {name} is not supported on a decode mesh")
        self.control = control
        self.mesh_kv = MeshDecodeKV(kv, metadata, control.ranks, first=control.first)
        self._clock = clock
        self._now = clock()
        self._relayed: queue.SimpleQueue[Item] = queue.SimpleQueue()
        #: Called on every rank with each relayed request before the peer takes it (what the
        #: HTTP front does beside submitting, such as registering a fake prompt).
        self.on_relayed: Callable[[NewRequest], None] | None = None
        super().__init__(kv=self.mesh_kv, metadata=metadata, clock=self.now, **options)

    def now(self) -> float:
        """The pass's agreed time (the first rank's clock at the start of the pass)."""
        return self._now

    def submit(self, req: NewRequest) -> None:
        self._relayed.put(req)

    def abort(self, rid: str, *, shutdown: bool = False, peer: str = "") -> None:
        self._relayed.put(AbortRequest(rid, shutdown, peer))

    def _pass(self) -> bool:
        """One pass on every rank (:meth:`step`): the relay, the clock, the receivers'
        agreement, then the peer's own pass. Raises :class:`scheduler.dist.relay.MeshStopped`
        once the first rank stopped the group."""
        items = self.control.relay.exchange(take_all(self._relayed))
        self._now = self.control.share_clock(self._clock())
        for item in items:
            if isinstance(item, AbortRequest):
                super().abort(item.rid, shutdown=item.shutdown, peer=item.peer)
            elif isinstance(item, NewRequest):  # (a decode peer keeps no prefix cache)
                if self.on_relayed is not None:
                    self.on_relayed(item)
                super().submit(item)
        self.mesh_kv.agree()
        return super()._pass() or bool(items)

    def idle(self) -> bool:
        """Whether this rank's peer holds nothing (not an agreement: see
        :meth:`DecodeMeshControl.all_agree`)."""
        return super().idle() and self._relayed.empty() and self.mesh_kv.live_rooms() == 0

    def stop(self) -> None:
        """On the first rank, in place of a pass: every other rank's next :meth:`step`
        raises :class:`scheduler.dist.relay.MeshStopped`."""
        self.control.relay.stop()
