"""The reference model's configuration: its shape, its seed, and the bounds that keep it exact."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from lifecycle.validators import typed_fields
from scheduler.model.byte_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

# The K/V cache dtypes that hold activation-grid values (20 significant bits) exactly.
_CACHE_DTYPES = (torch.float32, torch.float64)


def _int_in(lo: int, hi: int) -> Callable[[Any, attrs.Attribute[int], int], None]:
    def check(_instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(
                f"ModelConfig.{attribute.name} must be an integer in {lo}..{hi}, got {value!r}"
            )

    return check


def _above_one(_instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 1.0):
        raise ValueError(f"ModelConfig.{attribute.name} must be a finite number > 1, got {value!r}")


def _layer_list(_instance: Any, attribute: attrs.Attribute[tuple[int, ...]], value: Any) -> None:
    if not isinstance(value, tuple) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in value
    ):
        raise ValueError(
            f"ModelConfig.{attribute.name} must be a tuple of layer indices, got {value!r}"
        )
    if list(value) != sorted(set(value)):
        raise ValueError(
            f"ModelConfig.{attribute.name} must list distinct layers in ascending order, "
            f"got {value!r}"
        )


class LayerKind(enum.Enum):
    """What a layer computes and so what it keeps per request: ``FULL`` attention keeps every
    position's K/V, ``SWA`` (sliding-window attention) the last ``sliding_window`` positions',
    ``RECURRENT`` (an exact fixed-point linear recurrence) one state vector."""

    FULL = "full"
    SWA = "swa"
    RECURRENT = "recurrent"


def _cache_dtype(_instance: Any, attribute: attrs.Attribute[torch.dtype], value: Any) -> None:
    if value not in _CACHE_DTYPES:
        raise ValueError(
            f"ModelConfig.{attribute.name} must be torch.float32 or torch.float64 (they hold the "
            f"model's fixed-point K/V exactly), got {value!r}"
        )


@attrs.frozen(field_transformer=typed_fields)
class ModelConfig:
    """Shape and seed of the reference model.

    The upper bounds keep every sum of the fixed-point arithmetic below 2**53 units, which is
    what makes it exact (``fixed_point``). ``dtype`` is the K/V cache dtype: the pool
    the model writes into must have it.
    """

    vocab_size: int = attrs.field(default=VOCAB_SIZE, validator=_int_in(2, 1 << 20))
    hidden: int = attrs.field(default=64, validator=_int_in(1, 8192))
    layers: int = attrs.field(default=2, validator=_int_in(1, 256))
    heads: int = attrs.field(default=4, validator=_int_in(1, 1024))
    kv_heads: int = attrs.field(default=2, validator=_int_in(1, 1024))
    head_dim: int = attrs.field(default=16, validator=_int_in(2, 4096))
    intermediate: int = attrs.field(default=128, validator=_int_in(1, 1 << 20))
    rope_theta: float = attrs.field(default=10000.0, validator=_above_one)
    max_position: int = attrs.field(default=8192, validator=_int_in(1, 1 << 17))
    seed: int = attrs.field(default=0, validator=_int_in(0, 2**63 - 1))
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=_cache_dtype)
    eos_token_id: int = attrs.field(default=EOS_TOKEN_ID, validator=_int_in(0, (1 << 20) - 1))
    # Hybrid layers: which layers attend over a sliding window of ``sliding_window`` positions
    # (the query's own and the ``sliding_window - 1`` before it), and which run the recurrence
    # instead of attention. The rest are full attention; at least one must be.
    swa_layers: tuple[int, ...] = attrs.field(default=(), validator=_layer_list)
    sliding_window: int = attrs.field(default=0, validator=_int_in(0, 1 << 17))
    recurrent_layers: tuple[int, ...] = attrs.field(default=(), validator=_layer_list)

    def __attrs_post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.heads * self.head_dim > 1 << 16:
            raise ValueError(
                f"ModelConfig.heads * head_dim must be at most {1 << 16}, "
                f"got {self.heads * self.head_dim}"
            )
        if self.eos_token_id >= self.vocab_size:
            raise ValueError(
                f"ModelConfig.eos_token_id must be in 0..{self.vocab_size - 1}, "
                f"got {self.eos_token_id}"
            )
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        for name in ("swa_layers", "recurrent_layers"):
            listed: tuple[int, ...] = getattr(self, name)
            if listed and not 0 <= listed[0] <= listed[-1] < self.layers:
                raise ValueError(
                    f"ModelConfig.{name} must hold layer indices in 0..{self.layers - 1}, "
                    f"got {listed!r}"
                )
        both = set(self.swa_layers) & set(self.recurrent_layers)
        if both:
            raise ValueError(
                f"ModelConfig: layers {sorted(both)} are listed as both SWA and recurrent"
            )
        if bool(self.swa_layers) != bool(self.sliding_window):
            raise ValueError(
                "ModelConfig.sliding_window (the window in positions, >= 1) and swa_layers go "
                f"together: got sliding_window={self.sliding_window}, "
                f"swa_layers={self.swa_layers!r}"
            )
        if not self.full_layers:
            raise ValueError(
                "ModelConfig: at least one layer must be full attention (not in swa_layers or "
                f"recurrent_layers); all {self.layers} are hybrid"
            )

    def kind(self, layer: int) -> LayerKind:
        """What ``layer`` computes."""
        if layer in self.swa_layers:
            return LayerKind.SWA
        if layer in self.recurrent_layers:
            return LayerKind.RECURRENT
        return LayerKind.FULL

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The full-attention layers, in order: layer ``full_layers[i]`` is layer ``i`` of the
        full KV pool (as ``swa_layers[j]`` is layer ``j`` of the SWA pool and
        ``recurrent_layers[r]`` row ``r`` of the recurrent state)."""
        hybrid = set(self.swa_layers) | set(self.recurrent_layers)
        return tuple(i for i in range(self.layers) if i not in hybrid)

    @property
    def hybrid(self) -> bool:
        """Whether any layer is not full attention."""
        return bool(self.swa_layers or self.recurrent_layers)

    @property
    def recurrent_width(self) -> int:
        """Channels of a recurrent layer's state: its input projection is the attention
        layers' query projection (``heads * head_dim`` rows)."""
        return self.heads * self.head_dim

    def pool_index(self, layer: int) -> int:
        """``layer``'s index within the pool (or state rows) of its kind."""
        kind = self.kind(layer)
        listed = {LayerKind.FULL: self.full_layers, LayerKind.SWA: self.swa_layers,
                  LayerKind.RECURRENT: self.recurrent_layers}[kind]
        return listed.index(layer)

    def truncated(self, layers: int) -> ModelConfig:
        """This config's first ``layers`` layers (a draft model's shape: same vocabulary,
        seed and widths), the hybrid layers among them kept."""
        if not 1 <= layers <= self.layers:
            raise ValueError(f"a truncated model needs 1..{self.layers} layers, got {layers}")
        swa = tuple(i for i in self.swa_layers if i < layers)
        return attrs.evolve(
            self,
            layers=layers,
            swa_layers=swa,
            sliding_window=self.sliding_window if swa else 0,
            recurrent_layers=tuple(i for i in self.recurrent_layers if i < layers),
        )

    @classmethod
    def tiny(cls, seed: int = 0) -> ModelConfig:
        """The smallest useful shape (still GQA, still two layers), for fuzzing."""
        return cls(
            hidden=32,
            layers=2,
            heads=2,
            kv_heads=1,
            head_dim=8,
            intermediate=48,
            max_position=4096,
            seed=seed,
        )
