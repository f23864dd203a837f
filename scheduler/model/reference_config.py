"""The reference model's configuration: its shape, its seed, and the bounds that keep it exact."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

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


def _cache_dtype(_instance: Any, attribute: attrs.Attribute[torch.dtype], value: Any) -> None:
    if value not in _CACHE_DTYPES:
        raise ValueError(
            f"ModelConfig.{attribute.name} must be torch.float32 or torch.float64 (they hold the "
            f"model's fixed-point K/V exactly), got {value!r}"
        )


@attrs.frozen
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
