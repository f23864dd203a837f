"""A real checkpoint sharded over tensor-parallel ranks.

Theory of operation
-------------------
TP rank ``t`` of ``T`` holds query heads ``t*H/T .. (t+1)*H/T``, the KV heads
:class:`kv.layouts.TPLayout` gives it (the ones those query heads read; replicated when ``T``
exceeds the KV heads), the matching columns of the attention output projection, ``I/T`` rows
of the MLP's gate and up projections and the matching columns of its down projection, as the
reference model's shards do (:mod:`scheduler.model.sharded`). Norms, the embedding and the
output head are replicated. A rank's KV pool holds its KV heads of every layer.

The two products that sum over what is split (the output projection over heads, the down
projection over MLP rows) are partial on each rank. The ranks all-gather the partials and every
rank adds them in rank order, in float32 (bfloat16 partials too): the sum's floats then depend
only on the partials, not on how a collective's algorithm cuts the tensor (which follows its
size, so the batch), and a token's floats stay independent of its batch
(:mod:`scheduler.model.invariant`), on every rank alike. So a prefill and a decode at the same
TP size write and read the same KV, and every rank computes the same logits. Against one rank
the sums are reassociated: logits agree to float rounding, not bit for bit (the fixed-point
reference model's shards are exact).

Only TP: a pipeline stage of a real checkpoint is not built (``pp_size`` 1).

Every rank of a mesh must run the same batches in the same order: these calls are collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch
import torch.distributed as dist

from kv.layouts import LayoutError, TPLayout
from scheduler.model.checkpoint import Checkpoint, LlamaConfig
from scheduler.model.llama import RealModel
from scheduler.model.sharded import Mesh, ShardError

#: The projections split by output rows (heads, MLP rows) and by input columns.
_ROWS, _COLUMNS = ("q", "k", "v", "gate", "up"), ("o", "down")


def check_tp(config: LlamaConfig, tp_size: int) -> None:
    """Raises :class:`ShardError` (or :class:`kv.layouts.LayoutError`) when a checkpoint of
    ``config`` cannot be split over ``tp_size`` ranks."""
    for name, value in (("heads", config.heads), ("intermediate", config.intermediate)):
        if value % tp_size:
            sizes = ", ".join(map(str, tp_sizes(config)))
            raise ShardError(f"the checkpoint's {name} ({value}) must be a multiple of TP "
                             f"{tp_size} (TP sizes this checkpoint splits over: {sizes})")
    TPLayout(tp_size, config.kv_heads)


class HeadCounts(Protocol):
    """What decides the TP sizes a model splits over (a checkpoint's ``LlamaConfig``, the
    reference model's ``ModelConfig``)."""

    @property
    def heads(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def intermediate(self) -> int: ...


def tp_sizes(config: HeadCounts, most: int = 64) -> list[int]:
    """The TP sizes up to ``most`` a model of ``config`` splits over."""
    sizes = []
    for tp in range(1, most + 1):
        if config.heads % tp or config.intermediate % tp:
            continue
        try:
            TPLayout(tp, config.kv_heads)
        except LayoutError:
            continue
        sizes.append(tp)
    return sizes


class ShardedRealModel(RealModel):
    """The part of a real checkpoint one TP rank holds (see the module's docstring)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        mesh: Mesh,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        eos_token_ids: Sequence[int] = (),
        name: str | None = None,
    ) -> None:
        c = checkpoint.config
        if mesh.pp_size != 1:
            raise ShardError(f"a real checkpoint is sharded over TP ranks only, not over "
                             f"{mesh.pp_size} pipeline stages (PP 1)")
        check_tp(c, mesh.tp_size)
        self.mesh = mesh
        t, d = mesh.tp_rank, c.head_dim
        kv = TPLayout(mesh.tp_size, c.kv_heads).heads_of(t)
        q_per, rows_per = c.heads // mesh.tp_size, c.intermediate // mesh.tp_size
        heads = slice(t * q_per * d, (t + 1) * q_per * d)
        rows = slice(t * rows_per, (t + 1) * rows_per)
        kv_rows = slice(kv.start * d, kv.stop * d)
        self._slices = {"q": heads, "k": kv_rows, "v": kv_rows, "o": heads, "gate": rows,
                        "up": rows, "down": rows}
        super().__init__(checkpoint, dtype=dtype, device=device, eos_token_ids=eos_token_ids,
                         name=name)
        self.config = attrs.evolve(c, heads=q_per, kv_heads=len(kv), intermediate=rows_per)

    def _part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        kind = name.rsplit(".", 1)[-1]
        if kind in _ROWS:
            return tensor[self._slices[kind]]
        if kind in _COLUMNS:
            return tensor[:, self._slices[kind]]
        return tensor

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        m = self.mesh
        if m.tp_size == 1:
            return partial
        # Gathered as bytes (gloo gathers no bfloat16), added in rank order.
        bits = partial.contiguous().view(torch.uint8)
        parts = [torch.empty_like(bits) for _ in range(m.tp_size)]
        dist.all_gather(parts, bits, group=m.tp_group)
        total = parts[0].view(partial.dtype).float()  # bfloat16 partials added in float32
        for part in parts[1:]:
            total += part.view(partial.dtype)
        return total.to(partial.dtype)
