"""Real checkpoints: one loading interface for GGUF files and Hugging Face directories.

A :class:`Checkpoint` is what the Llama runner needs, whatever the file format: a validated
:class:`LlamaConfig`, the weights as float32 tensors under one naming scheme (Hugging Face's
layout: ``[out_features, in_features]``, rotary halves as ``rotate_half`` expects), the
tokenizer's source and a fingerprint of the weights.

- :func:`scheduler.model.loader.load_checkpoint` takes a ``.gguf`` file
  (:mod:`scheduler.model.gguf_checkpoint` dequantizes it) or a directory with ``config.json``
  and ``*.safetensors``.
- A checkpoint of another architecture is refused with :class:`UnsupportedCheckpoint` naming
  it. Nothing here touches the network: a model is a local path.

Weight names: ``embed``, ``norm``, ``lm_head`` (absent when tied to ``embed``) and per layer
``layers.{i}.{attn_norm,q,k,v,o,mlp_norm,gate,up,down}``; ``rope_freqs`` when the checkpoint
carries per-frequency RoPE factors (GGUF files of Llama 3.1 do).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from lifecycle.validators import one_of

#: The architectures this runner computes (GGUF ``general.architecture``, HF ``model_type``).
LLAMA_ARCHITECTURES = frozenset({"llama"})

_LAYER_PARTS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing files or tensors, wrong shapes."""


class UnsupportedCheckpoint(CheckpointError):
    """A checkpoint of an architecture (or with a feature) this runner does not compute."""


@attrs.frozen
class RopeScaling:
    """RoPE frequency scaling as Hugging Face's Llama defines it (``linear`` or ``llama3``)."""

    kind: str = attrs.field(validator=one_of(("linear", "llama3")))
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def _positive(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"LlamaConfig.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class LlamaConfig:
    """The shape of a Llama-family decoder, read from a checkpoint."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden: int = attrs.field(validator=_positive)
    layers: int = attrs.field(validator=_positive)
    heads: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    intermediate: int = attrs.field(validator=_positive)
    rms_eps: float = attrs.field(validator=_positive)
    rope_theta: float = attrs.field(validator=_positive)
    max_position: int = attrs.field(validator=_positive)
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None

    def __attrs_post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise CheckpointError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers, in float32."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 4


@attrs.frozen
class TokenizerSource:
    """Where the checkpoint's tokenizer comes from: a directory with ``tokenizer.json``, or the
    ``tokenizer.*`` fields of a GGUF file."""

    directory: Path | None = None
    gguf_fields: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class Checkpoint:
    name: str
    path: Path
    format: str  # "gguf" or "safetensors"
    config: LlamaConfig
    tensors: Mapping[str, torch.Tensor]
    tokenizer: TokenizerSource
    fingerprint: str


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every weight a checkpoint of config ``c`` must hold."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    per_layer = {
        "attn_norm": (c.hidden,), "q": (q, c.hidden), "k": (kv, c.hidden), "v": (kv, c.hidden),
        "o": (c.hidden, q), "mlp_norm": (c.hidden,), "gate": (c.intermediate, c.hidden),
        "up": (c.intermediate, c.hidden), "down": (c.hidden, c.intermediate),
    }
    shapes = {"embed": (c.vocab_size, c.hidden), "norm": (c.hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.vocab_size, c.hidden)
    for i in range(c.layers):
        shapes.update({f"layers.{i}.{part}": per_layer[part] for part in _LAYER_PARTS})
    return shapes


def check_tensors(where: Path, config: LlamaConfig, tensors: Mapping[str, torch.Tensor],
                  native: Callable[[str], str] = str) -> None:
    """Raise :class:`CheckpointError` naming the first missing, misshapen or unknown weight
    (``native``: a weight's name as the checkpoint's format writes it)."""
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        if name not in tensors:
            raise CheckpointError(f"{where}: weight {native(name)!r} is missing")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{where}: weight {native(name)!r} has shape {tuple(tensors[name].shape)}, "
                f"the config says {shape}")
    freqs = tensors.get("rope_freqs")
    if freqs is not None and tuple(freqs.shape) != (config.head_dim // 2,):
        raise CheckpointError(
            f"{where}: weight {native('rope_freqs')!r} has shape {tuple(freqs.shape)}, the "
            f"config says {(config.head_dim // 2,)} (one factor per rotary frequency)")
    if freqs is not None and config.rope_scaling is not None:
        raise UnsupportedCheckpoint(
            f"{where}: the checkpoint carries per-frequency RoPE factors "
            f"({native('rope_freqs')!r}) and a {config.rope_scaling.kind} RoPE scaling; the "
            "runner applies one or the other, not both")
    extra = sorted(set(tensors) - set(shapes) - {"rope_freqs"})
    if extra:
        raise UnsupportedCheckpoint(
            f"{where}: weights this Llama runner does not compute: {extra[:5]}")


class WeightDigest:
    """The fingerprint of a checkpoint: a digest of its config and of every weight as its file
    holds it (the name, the type, the shape and every byte of the data, before any
    dequantization or conversion), which decides whether two pools may exchange KV.

    Each tensor is hashed as it is read (:meth:`add`), in the order the file lists them (the
    order does not change the fingerprint). SHA-256 runs at about 1 GB/s on the development
    machine: 0.1 s of the 4.4 s SmolLM2's 92 MiB of quantized tensors take to load."""

    def __init__(self) -> None:
        self._tensors: dict[str, bytes] = {}

    def add(self, name: str, kind: str, shape: Sequence[int], data: Any) -> None:
        """Tensor ``name`` of type ``kind`` (``F32``, ``Q4_1``, ``bfloat16``, ...) and
        ``shape``, its bytes ``data`` (a C-contiguous buffer: a numpy array, bytes)."""
        digest = hashlib.sha256(f"{name}\0{kind}\0{tuple(shape)}\0".encode())
        digest.update(data)
        self._tensors[name] = digest.digest()

    def fingerprint(self, config: LlamaConfig) -> str:
        digest = hashlib.sha256(repr(attrs.astuple(config)).encode())
        for name in sorted(self._tensors):
            digest.update(self._tensors[name])
        return digest.hexdigest()[:16]


def read_json(file: Path) -> Any:
    """The JSON ``file`` holds; :class:`CheckpointError` naming the file where it is not JSON
    (``json``'s own message says only where in the text it stopped) or cannot be read."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({exc.strerror or exc})") from exc
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc


def check_in_vocabulary(where: str, field: str, ids: Iterable[int], vocab_size: int) -> None:
    """Refuse token ids of ``field`` (``where``: the file, and in it the field's name as the
    file has it) that the model's vocabulary of ``vocab_size`` tokens does not hold: an EOS id
    beyond it could never be sampled, so answers would never end on it."""
    for token in ids:
        if token >= vocab_size:
            raise CheckpointError(f"{where}: {field} {token} is not a token id of the model's "
                                  f"vocabulary of {vocab_size} tokens (0..{vocab_size - 1})")


def refuse_architecture(where: Path, architecture: object) -> None:
    if architecture is None:
        raise UnsupportedCheckpoint(
            f"{where}: the checkpoint does not say its architecture (no model_type in "
            f"config.json, or general.architecture in the GGUF file); pdlife's runner computes "
            f"Llama-family checkpoints ({', '.join(sorted(LLAMA_ARCHITECTURES))})")
    if architecture not in LLAMA_ARCHITECTURES:
        raise UnsupportedCheckpoint(
            f"{where}: the checkpoint's architecture is {architecture!r}; pdlife's runner "
            f"computes Llama-family checkpoints ({', '.join(sorted(LLAMA_ARCHITECTURES))})")


def unsupported_tensor(where: Path, name: str) -> UnsupportedCheckpoint:
    """The refusal of a weight that is no part of a Llama decoder, ``name`` as the file has it."""
    return UnsupportedCheckpoint(f"{where}: tensor {name!r} is not part of a Llama decoder")


def unsupported_rope_scaling(where: Path, kind: object) -> UnsupportedCheckpoint:
    """The refusal of a RoPE scaling ``kind`` this runner does not compute."""
    return UnsupportedCheckpoint(f"{where}: RoPE scaling {kind!r} is not supported")


def rope_inv_freq(config: LlamaConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The rotary inverse frequencies (float32), scaled as the config says."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float32)
    elif s is not None and s.kind == "linear":
        inv = inv / s.factor
    elif s is not None and s.kind == "llama3":
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv
