"""The reference model's decoder: seeded weights and the per-position arithmetic of a small
Llama-style model (RMSNorm, RoPE, grouped-query attention, SwiGLU, untied output head).

:class:`LlamaModel` owns no cache: the drivers in :mod:`scheduler.model.reference` (the colocated
twin and the paged runner) own the K/V and call these methods, which compute every position's
bits independently of how positions are batched or chunked (:mod:`scheduler.model.fixed_point`
explains why). An input the model cannot compute raises :class:`ModelInputError`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Iterable, Sequence

import attrs
import torch

from kv.pool import KVPool
from kv.pool_layout import KVLayout
from scheduler.model.fixed_point import (
    DECAY_RANGE,
    WEIGHT_FRAC_BITS,
    WEIGHT_LIMIT,
    causal_attention,
    exp_table,
    fix,
    from_units,
    greedy_token_ids,
    linear_recurrence,
    rms_norm,
    rope_tables,
    rotate,
    silu,
    to_grid,
    to_units,
)
from scheduler.model.reference_config import ModelConfig
from scheduler.runner import outside_vocabulary

logger = logging.getLogger(__name__)

_RMS_EPS = 1e-5


class ModelInputError(ValueError):
    """A forward item or generation request the model cannot compute (bad ids, positions past
    ``max_position``, a page table too short). The request should be failed, not retried."""

    def __init__(self, rid: str, problem: str) -> None:
        super().__init__(f"request {rid!r}: {problem}")
        self.rid = rid
        self.problem = problem


_USE = "use 'cpu', 'cuda', 'cuda:N' or 'auto' (--device on the command line)"


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; anything else is taken as given, but a
    device this torch cannot compute on is refused (``ValueError``) here, not in the first
    forward: a name torch does not know, ``meta`` (its tensors hold no data), a CUDA device
    where torch has none or an index past its devices, another accelerator (``mps``, ``xpu``,
    ...) this build has not or does not find."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:  # torch's message lists every device type it was ever built for
        raise ValueError(f"device {str(device)!r} is not a device torch knows: {_USE}") from None
    kind = resolved.type
    if kind == "cpu":
        return resolved
    if kind == "meta":
        raise ValueError(f"device {str(device)!r} holds no data (tensors there have a shape "
                         f"and no values), so no model computes there: {_USE}")
    if kind == "cuda" and not torch.cuda.is_available():
        built = "has no CUDA build" if torch.version.cuda is None else "finds no CUDA device"
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) {built}; "
                         f"use device 'cpu' or 'auto' (--device on the command line)")
    if kind == "cuda" and resolved.index is not None \
            and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} "
                         f"CUDA device(s), numbered from 0: {_USE}")
    if kind != "cuda" and not _available(kind):
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) has no "
                         f"{kind} device it can use: {_USE}")
    return resolved


def _available(kind: str) -> bool:
    """Whether torch's backend module for the device type ``kind`` (``torch.mps``,
    ``torch.xpu``, ...) says a device is there; a type without one is not."""
    is_available = getattr(getattr(torch, kind, None), "is_available", None)
    return callable(is_available) and bool(is_available())


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (a CUDA device without an index matches any)."""
    if a.type != b.type:
        return False
    return a.type == "cpu" or a.index is None or b.index is None or a.index == b.index


@attrs.frozen(eq=False)
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class LlamaModel:
    """Seeded weights and the per-position arithmetic; drivers own the K/V cache."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = resolve_device(device)
        # Weights and tables are made on the CPU and moved, so every device gets the same bits.
        gen = torch.Generator().manual_seed(config.seed)
        h, i = config.hidden, config.intermediate
        q_dim, kv_dim = config.heads * config.head_dim, config.kv_heads * config.head_dim

        def weight(out_dim: int, in_dim: int) -> torch.Tensor:
            w = torch.randn((out_dim, in_dim), generator=gen, dtype=torch.float64)
            return to_grid(w / math.sqrt(in_dim), WEIGHT_FRAC_BITS, WEIGHT_LIMIT).to(self.device)

        def ones(dim: int) -> torch.Tensor:
            return torch.ones(dim, dtype=torch.float64, device=self.device)

        self._embed = fix(
            torch.randn((config.vocab_size, h), generator=gen, dtype=torch.float64)
        ).to(self.device)
        self._layers = [
            _Layer(
                attn_norm=ones(h),
                wq=weight(q_dim, h),
                wk=weight(kv_dim, h),
                wv=weight(kv_dim, h),
                wo=weight(h, q_dim),
                mlp_norm=ones(h),
                w_gate=weight(i, h),
                w_up=weight(i, h),
                w_down=weight(h, i),
            )
            for _ in range(config.layers)
        ]
        self._final_norm = ones(h)
        self._lm_head = weight(config.vocab_size, h)
        # Drawn after every other weight, so the weights of a model without recurrent layers
        # are what they were before the recurrence existed.
        lo, hi = DECAY_RANGE
        self._decay = {
            layer: torch.randint(lo, hi + 1, (config.recurrent_width,), generator=gen).to(
                self.device
            )
            for layer in config.recurrent_layers
        }
        self._draft_of: tuple[ModelConfig, str] | None = None
        cos, sin = rope_tables(config.head_dim, config.rope_theta, config.max_position)
        self._cos, self._sin = cos.to(self.device), sin.to(self.device)
        self._exp = exp_table().to(self.device)
        self._q_scale = 1.0 / math.sqrt(config.head_dim)
        logger.debug("built reference model %s on %s", config, self.device)

    def to(self, device: str | torch.device) -> LlamaModel:
        """This model on ``device`` (itself when already there; the seed rebuilds the rest)."""
        target = resolve_device(device)
        if same_device(target, self.device):
            return self
        if self._draft_of is not None:
            return LlamaModel(self._draft_of[0], target).draft(self.config.layers)
        return LlamaModel(self.config, target)

    def draft(self, layers: int) -> LlamaModel:
        """A draft model for speculative decoding: this model's first ``layers`` layers with
        its embedding, final norm and output head (same vocabulary). The weights are shared,
        not copied; the draft's greedy tokens often agree with this model's because it is
        this model with its last layers skipped."""
        if self._draft_of is not None:
            raise ValueError("a draft model is not drafted from again; draft from the target")
        model = copy.copy(self)
        model.config = self.config.truncated(layers)
        model._layers = self._layers[:layers]
        model._decay = {i: d for i, d in self._decay.items() if i < layers}
        model._draft_of = (self.config, self.fingerprint)
        return model

    @property
    def fingerprint(self) -> str:
        """Names this model's KV (:mod:`kv.model_id`): the config decides every weight (a
        draft's: its target's and its layer count)."""
        if self._draft_of is not None:
            return f"{self._draft_of[1]}-draft{self.config.layers}"
        fields = attrs.asdict(self.config, recurse=False)
        # Fields still at their defaults stay out, so a config that does not use a field
        # added later keeps its fingerprint.
        for name in ("swa_layers", "sliding_window", "recurrent_layers"):
            if not fields[name]:
                del fields[name]
        digest = hashlib.sha256(repr(tuple(fields.values())).encode()).hexdigest()[:16]
        return f"reference-{digest}"

    def make_pool(self, *, num_pages: int, page_size: int,
                  layout: KVLayout = KVLayout.LAYER_MAJOR) -> KVPool:
        """An empty KV pool for this model's full-attention layers, on its device, in
        ``layout``."""
        return self._pool(len(self.config.full_layers), num_pages, page_size, layout)

    def make_swa_pool(self, *, num_pages: int, page_size: int,
                      layout: KVLayout = KVLayout.LAYER_MAJOR) -> KVPool:
        """An empty KV pool for this model's sliding-window layers (its own page indices)."""
        if not self.config.swa_layers:
            raise ValueError("this model has no sliding-window layers (ModelConfig.swa_layers)")
        return self._pool(len(self.config.swa_layers), num_pages, page_size, layout)

    def make_states(self, slots: int) -> torch.Tensor:
        """Zeroed recurrent states: int64 ``[recurrent layers, slots, recurrent_width]``, one
        slot per request (counts of the activation unit)."""
        c = self.config
        if not c.recurrent_layers:
            raise ValueError("this model has no recurrent layers (ModelConfig.recurrent_layers)")
        return torch.zeros((len(c.recurrent_layers), slots, c.recurrent_width),
                           dtype=torch.int64, device=self.device)

    def _pool(self, layers: int, num_pages: int, page_size: int, layout: KVLayout) -> KVPool:
        c = self.config
        return KVPool(
            num_layers=layers,
            num_pages=num_pages,
            page_size=page_size,
            kv_heads=c.kv_heads,
            head_dim=c.head_dim,
            dtype=c.dtype,
            device=self.device,
            model=self.fingerprint,
            model_name="reference",
            layout=layout,
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids to the ``[n, hidden]`` residual stream."""
        return self._embed[token_ids]

    def attention_inputs(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[n, heads, head_dim]`` (scaled), keys and values ``[n, kv_heads, head_dim]``
        of ``x`` at ``positions``, RoPE applied to queries and keys."""
        c, w, n = self.config, self._layers[layer], x.shape[0]
        h = rms_norm(x, w.attn_norm, _RMS_EPS)
        q = fix(h @ w.wq.T).view(n, c.heads, c.head_dim)
        k = fix(h @ w.wk.T).view(n, c.kv_heads, c.head_dim)
        v = fix(h @ w.wv.T).view(n, c.kv_heads, c.head_dim)
        cos, sin = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
        return fix(rotate(q, cos, sin) * self._q_scale), fix(rotate(k, cos, sin)), v

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
        key_start: int = 0,
    ) -> torch.Tensor:
        """Causal attention of ``layer``'s queries at ``q_start ..`` over the keys of positions
        ``key_start ..`` (0 for a full-attention layer; a sliding-window layer's queries see
        only their window, so its keys may start at :meth:`window_start` of ``q_start``)."""
        return causal_attention(q, k, v, q_start, self._exp, key_start=key_start,
                                window=self.window(layer))

    @property
    def exp_table(self) -> torch.Tensor:
        """The model's ``exp(-x)`` table (:func:`~scheduler.model.fixed_point.exp_table`)."""
        return self._exp

    def window(self, layer: int) -> int:
        """The positions ``layer``'s queries see: its window, or 0 for all of them."""
        c = self.config
        return c.sliding_window if layer in c.swa_layers else 0

    def window_start(self, layer: int, position: int) -> int:
        """The first key position a query of ``layer`` at ``position`` sees."""
        w = self.window(layer)
        return max(0, position - w + 1) if w else 0

    def recurrent(
        self, layer: int, x: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent ``layer`` over the positions of ``x`` from ``state`` (int64
        ``[recurrent_width]``, the state after the previous position; zeros at position 0).

        The layer's input projection is its query weights and its output projection its
        attention output weights (:meth:`layer_output`). Returns the layer's attention-shaped
        output ``[n, recurrent_width]`` (the states on the grid) and the int64 states
        ``[n, recurrent_width]``; the last row is the state to keep."""
        w = self._layers[layer]
        u = to_units(fix(rms_norm(x, w.attn_norm, _RMS_EPS) @ w.wq.T))
        states = linear_recurrence(u, self._decay[layer], state)
        return from_units(states), states

    def layer_output(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer's output projection and SwiGLU MLP."""
        w = self._layers[layer]
        x = fix(x + self.project(attn, w.wo))
        h = rms_norm(x, w.mlp_norm, _RMS_EPS)
        gate, up = fix(h @ w.w_gate.T), fix(h @ w.w_up.T)
        return fix(x + self.project(fix(silu(gate, self._exp) * up), w.w_down))

    def project(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``a @ w.T`` for the two products that sum over heads or MLP rows (the attention
        output and the MLP down projection), exact on the grid: the sharded model
        (:mod:`scheduler.model.sharded`) sums them over its TP ranks."""
        return a @ w.T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 logits of each row of the final residual stream (exact: a sum of
        products on the grid)."""
        return rms_norm(x, self._final_norm, _RMS_EPS) @ self._lm_head.T

    def next_tokens(self, x_last: torch.Tensor) -> list[int]:
        """The greedy next token of each row of the final residual stream."""
        ids: list[int] = greedy_token_ids(self.logits(x_last)).tolist()
        return ids

    def check_tokens(self, rid: str, token_ids: Sequence[int]) -> None:
        """Raise :class:`ModelInputError` unless every id is in the vocabulary."""
        problem = outside_vocabulary(token_ids, self.config.vocab_size)
        if problem:
            raise ModelInputError(rid, problem)

    def stop_ids(self, stop_token_ids: Iterable[int], ignore_eos: bool) -> frozenset[int]:
        """The ids that end a generation: ``stop_token_ids``, and EOS unless ``ignore_eos``."""
        stops = set(stop_token_ids)
        if not ignore_eos:
            stops.add(self.config.eos_token_id)
        return frozenset(stops)
