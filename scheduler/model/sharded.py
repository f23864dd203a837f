"""The reference model sharded over tensor- and pipeline-parallel ranks, bit for bit the same.

Theory of operation
-------------------
A mesh of ``tp_size x pp_size`` ranks (:class:`Mesh`) runs one reference model. Pipeline stage
``s`` holds a contiguous range of layers (:func:`stage_layers`). Within a stage, TP rank ``t``
holds query heads ``t*H/T .. (t+1)*H/T``, the KV heads :class:`kv.layouts.TPLayout` gives it
(which are the ones those query heads read), the matching columns of the attention output
projection, ``I/T`` rows of the MLP's gate and up projections and the matching columns of its
down projection. Norms, the embedding and the output head are replicated. A rank's KV pool
holds only its heads and its stage's layers (:meth:`ShardedLlama.make_pool`).

Exactness. The two products that sum over what is split, the attention output projection (over
heads) and the MLP down projection (over MLP rows), are computed as partial sums, one per rank.
On the fixed-point grid (:mod:`scheduler.model.fixed_point`) every term is an integer multiple
of ``2**-24`` and every sum stays below ``2**53`` of them, so each partial is an exact count of
that unit. The ranks add the counts as int64 over the stage's TP group; an integer sum does not
depend on its order, so the total is the unsharded product, bit for bit. Everything else a rank
computes is replicated (norms, residual adds, the output head) or per head and per MLP row,
which sharding does not change. So every layout computes the same logits as one rank.

Drivers. :class:`ShardedLlama` is a :class:`~scheduler.model.decoder.LlamaModel` whose
``config`` is the shard's own (its heads, KV heads, MLP rows and layers; ``full_config`` is the
model's), so the drivers of :mod:`scheduler.model.reference` (the paged runner, the colocated
twin, greedy decoding from a pool) run it unchanged: the shard's layer ``i`` is model layer
``layers.start + i``. The pipeline's hand-offs sit where those drivers already call the model:
on a later stage ``embed`` receives the previous stage's residual stream (from the same TP
rank) instead of looking tokens up; a stage that is not the last sends its residual stream on
after its last layer; ``logits`` (and so ``next_tokens``) are computed on the last stage and
broadcast to every rank of the mesh, so every rank returns the same tokens.

Every rank of a mesh must run the same batches in the same order: these calls are collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from kv.layouts import TPLayout
from scheduler.model.decoder import LlamaModel, resolve_device, same_device
from scheduler.model.fixed_point import ACT_FRAC_BITS, WEIGHT_FRAC_BITS
from scheduler.model.reference_config import ModelConfig

# A product of an activation and a weight is a multiple of this: the unit of the exact sums.
_PRODUCT_UNIT = 2.0 ** -(ACT_FRAC_BITS + WEIGHT_FRAC_BITS)


class ShardError(ValueError):
    """A mesh the model cannot be split over (sizes that do not divide, too few layers)."""


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The model layers pipeline stage ``stage`` of ``pp_size`` holds: contiguous, as even as
    the count allows (later stages take the extra ones)."""
    if not 1 <= pp_size <= num_layers:
        raise ShardError(f"pp_size must be in 1..{num_layers} (the layers), got {pp_size}")
    if not 0 <= stage < pp_size:
        raise ShardError(f"stage {stage} is not in 0..{pp_size - 1}")
    return range(stage * num_layers // pp_size, (stage + 1) * num_layers // pp_size)


@attrs.frozen(eq=False)
class Mesh:
    """This rank's place in a ``tp_size x pp_size`` mesh, and the groups it talks over.

    ``ranks[s * tp_size + t]`` is the global rank of TP rank ``t`` of stage ``s``.
    ``tp_group`` holds this rank's stage; ``group`` every rank of the mesh. Build one with
    :func:`build_mesh`, or :meth:`single` for one rank and no process group.
    """

    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    ranks: tuple[int, ...]
    tp_group: Any = None
    group: Any = None

    @classmethod
    def single(cls) -> Mesh:
        return cls(tp_size=1, pp_size=1, tp_rank=0, pp_rank=0, ranks=(0,))

    def rank_of(self, stage: int, tp_rank: int) -> int:
        """The global rank of TP rank ``tp_rank`` of stage ``stage``."""
        return self.ranks[stage * self.tp_size + tp_rank]

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def build_mesh(tp_size: int, pp_size: int, ranks: Sequence[int] | None = None) -> Mesh | None:
    """The mesh of ``ranks`` (default: every rank of the default group), stage-major; None on a
    rank that is not one of them.

    Every rank of the default group must call it, with the same arguments, since creating a
    process group is itself a collective.
    """
    members = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
    if tp_size < 1 or pp_size < 1 or len(members) != tp_size * pp_size:
        raise ShardError(
            f"a mesh of TP {tp_size} x PP {pp_size} needs {tp_size * pp_size} ranks, "
            f"got {len(members)}"
        )
    tp_groups = [
        dist.new_group(list(members[s * tp_size : (s + 1) * tp_size])) for s in range(pp_size)
    ]
    group = dist.new_group(list(members))
    me = dist.get_rank()
    if me not in members:
        return None
    stage, tp_rank = divmod(members.index(me), tp_size)
    return Mesh(tp_size=tp_size, pp_size=pp_size, tp_rank=tp_rank, pp_rank=stage,
                ranks=members, tp_group=tp_groups[stage], group=group)


class ShardedLlama(LlamaModel):
    """The part of the reference model one rank of a mesh holds (see the module's docstring)."""

    def __init__(
        self, config: ModelConfig, mesh: Mesh, device: str | torch.device = "cpu"
    ) -> None:
        tp = mesh.tp_size
        if config.hybrid:
            raise ShardError("a hybrid config (swa_layers, recurrent_layers) is not sharded; "
                             "run it on one rank")
        for name, value in (("heads", config.heads), ("intermediate", config.intermediate)):
            if value % tp:
                raise ShardError(f"ModelConfig.{name} ({value}) must be a multiple of TP {tp}")
        kv_heads = TPLayout(tp, config.kv_heads).heads_of(mesh.tp_rank)
        self.layers = stage_layers(config.layers, mesh.pp_size, mesh.pp_rank)
        super().__init__(config, device)
        self.full_config = config
        self.mesh = mesh
        self._fingerprint = super().fingerprint  # the KV belongs to the whole model
        t, d = mesh.tp_rank, config.head_dim
        q_per, rows_per = config.heads // tp, config.intermediate // tp
        q = slice(t * q_per * d, (t + 1) * q_per * d)
        kv = slice(kv_heads.start * d, kv_heads.stop * d)
        rows = slice(t * rows_per, (t + 1) * rows_per)
        self._layers = [
            attrs.evolve(
                w,
                wq=w.wq[q].contiguous(),
                wk=w.wk[kv].contiguous(),
                wv=w.wv[kv].contiguous(),
                wo=w.wo[:, q].contiguous(),
                w_gate=w.w_gate[rows].contiguous(),
                w_up=w.w_up[rows].contiguous(),
                w_down=w.w_down[:, rows].contiguous(),
            )
            for w in self._layers[self.layers.start : self.layers.stop]
        ]
        self.config = attrs.evolve(
            config, heads=q_per, kv_heads=len(kv_heads), intermediate=rows_per,
            layers=len(self.layers),
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def to(self, device: str | torch.device) -> ShardedLlama:
        target = resolve_device(device)
        if same_device(target, self.device):
            return self
        return ShardedLlama(self.full_config, self.mesh, target)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Stage 0: the tokens' embeddings. A later stage: the previous stage's residual
        stream for the same positions."""
        m = self.mesh
        if m.pp_rank == 0:
            return super().embed(token_ids)
        x = torch.empty((token_ids.shape[0], self.config.hidden), dtype=torch.float64,
                        device=self.device)
        dist.recv(x, src=m.rank_of(m.pp_rank - 1, m.tp_rank))
        return x

    def layer_output(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer; after a stage's last layer it also goes on to
        the next stage."""
        out = super().layer_output(layer, x, attn)
        m = self.mesh
        if layer == len(self.layers) - 1 and not m.last_stage:
            dist.send(out, dst=m.rank_of(m.pp_rank + 1, m.tp_rank))
        return out

    def project(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``a @ w.T``, this rank's part summed exactly (as int64 counts of the product unit)
        over the stage's TP ranks."""
        partial = a @ w.T
        if self.mesh.tp_size == 1:
            return partial
        units = partial / _PRODUCT_UNIT
        counts = units.to(torch.int64)
        if not torch.equal(counts.to(torch.float64), units):
            raise AssertionError("a partial product left the fixed-point grid")
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.mesh.tp_group)
        return counts.to(torch.float64) * _PRODUCT_UNIT

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's logits, on every rank of the mesh."""
        m = self.mesh
        if m.pp_size == 1:
            return super().logits(x)
        if m.last_stage:
            out = super().logits(x)
        else:
            out = torch.empty((*x.shape[:-1], self.config.vocab_size), dtype=torch.float64,
                              device=self.device)
        dist.broadcast(out, src=m.rank_of(m.pp_size - 1, 0), group=m.group)
        return out
