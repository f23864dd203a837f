"""The prefill scheduler on a TP x PP mesh: the process groups its agreements run over.

Theory of operation
-------------------
Every rank of a mesh (:class:`scheduler.model.sharded.Mesh`) runs a
:class:`~scheduler.prefill.scheduler.PrefillScheduler` over its shard of the model
(:class:`~scheduler.model.sharded.ShardedLlama`: its KV heads of its stage's layers) and its
own KV senders. The ranks stay in lockstep, forming the same batches on the same passes,
because three agreements run each pass, each over a process group of its own:

- **the inbox relay**, over the whole mesh: the first rank (stage 0, TP rank 0: the one
  behind the HTTP front) broadcasts the requests and aborts that reached it, and every rank
  admits exactly those (:mod:`scheduler.dist.relay`);
- **the poll agreement**, over the stage's TP ranks: the rooms to poll and the MIN of their
  polls (:class:`scheduler.dist.ranks.TorchRanks`);
- **the stage agreement** (PP > 1), over one rank per stage (TP rank ``t`` of every stage):
  which requests are bootstrapped, failed and transferred (:mod:`.pipeline`).

With the same requests, the same verdicts and the same pool sizes, every rank's planner picks
the same batch; the forward's own collectives (the TP sums, the stage hand-offs, the logits
broadcast) then run on the model's groups. The scheduler's groups are separate from the
model's so that an agreement on the loop's thread never interleaves with a forward's
collective on the device thread of the overlap loop.

Building the groups is a collective of the whole default group (``torch.distributed``
creates every group on every rank), so every rank calls :func:`build_mesh_control`, members
of the mesh or not, with the same arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TypedDict

import attrs
import torch
import torch.distributed as dist

from kv.rank_table import RankPlace
from scheduler.dist.ranks import RankSync, TorchRanks
from scheduler.dist.relay import InboxRelay
from scheduler.dist.stages import StageConsensus, TorchStageGather
from scheduler.model.sharded import Mesh, build_mesh, stage_layers
from scheduler.prefill.pipeline import StagePolls


class MeshOptions(TypedDict, total=False):
    """The :class:`~scheduler.prefill.scheduler.PrefillScheduler` arguments of a mesh rank."""

    ranks: RankSync | None
    relay: InboxRelay | None
    stages: StagePolls | None


@attrs.frozen(eq=False)
class MeshControl:
    """What one rank's scheduler agrees over (see the module docstring)."""

    mesh: Mesh
    ranks: TorchRanks
    relay: InboxRelay
    stages: StagePolls | None
    group: Any  # the whole mesh, for the loop's own agreements (idle, stop)

    @property
    def first(self) -> bool:
        """Whether this rank takes the requests (and answers them)."""
        return self.relay.rank == self.relay.src

    def scheduler_options(self) -> MeshOptions:
        """The :class:`~scheduler.prefill.scheduler.PrefillScheduler` arguments of a rank."""
        return MeshOptions(ranks=self.ranks, relay=self.relay, stages=self.stages)

    def rank_place(self, *, num_layers: int, kv_heads: int, dp_rank: int = 0,
                   dp_size: int = 1) -> RankPlace:
        """This rank's place, as it registers at the bootstrap endpoint (a model of
        ``num_layers`` layers and ``kv_heads`` KV heads; this mesh is DP replica ``dp_rank``
        of ``dp_size``)."""
        m = self.mesh
        layers = stage_layers(num_layers, m.pp_size, m.pp_rank)
        return RankPlace(tp_rank=m.tp_rank, tp_size=m.tp_size, pp_rank=m.pp_rank,
                         pp_size=m.pp_size, dp_rank=dp_rank, dp_size=dp_size,
                         kv_heads=kv_heads, num_layers=num_layers,
                         layer_start=layers.start, layer_stop=layers.stop)

    def all_agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on every rank (a collective)."""
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())


def build_mesh_control(
    tp_size: int, pp_size: int, ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
) -> MeshControl | None:
    """The mesh of ``ranks`` (default: every rank of the default group, stage-major) and the
    scheduler's groups over it; None on a rank that is not one of them. Every rank of the
    default group calls it with the same arguments. ``timeout`` bounds one collective of the
    scheduler's groups (default: the default group's): how long the other ranks may wait for
    an idle first rank's next pass."""
    members = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
    if list(members) != sorted(set(members)):
        # A group's ranks are numbered in global order: the stage gather's rows come back in
        # stage order only when the stages' ranks ascend.
        raise ValueError(f"the mesh's ranks must ascend, got {members}")
    mesh = build_mesh(tp_size, pp_size, members)
    tp_groups = [dist.new_group(list(members[s * tp_size : (s + 1) * tp_size]), timeout=timeout)
                 for s in range(pp_size)]
    stage_groups = [dist.new_group([members[s * tp_size + t] for s in range(pp_size)],
                                   timeout=timeout)
                    for t in range(tp_size)]
    whole = dist.new_group(list(members), timeout=timeout)
    if mesh is None:
        return None
    stages = None
    if pp_size > 1:
        stages = StagePolls(StageConsensus(mesh.pp_rank, pp_size),
                            TorchStageGather(stage_groups[mesh.tp_rank]))
    return MeshControl(
        mesh=mesh, ranks=TorchRanks(tp_groups[mesh.pp_rank]),
        relay=InboxRelay(whole, src=members[0]), stages=stages, group=whole,
    )
