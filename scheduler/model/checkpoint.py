"""Real checkpoints: one loading interface for GGUF files and Hugging Face directories.

A :class:`Checkpoint` is what the Llama runner needs, whatever the file format: a validated
:class:`LlamaConfig`, the weights as float32 tensors under one naming scheme (Hugging Face's
layout: ``[out_features, in_features]``, rotary halves as ``rotate_half`` expects), the
tokenizer's source and a fingerprint of the weights.

- :func:`load_checkpoint` takes a ``.gguf`` file (:mod:`scheduler.model.gguf_checkpoint`
  dequantizes it) or a directory with ``config.json`` and ``*.safetensors``.
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

#: The architectures this runner computes (GGUF ``general.architecture``, HF ``model_type``).
LLAMA_ARCHITECTURES = frozenset({"llama"})

_LAYER_PARTS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")
_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "post_attention_layernorm": "mlp_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing files or tensors, wrong shapes."""


class UnsupportedCheckpoint(CheckpointError):
    """A checkpoint of an architecture (or with a feature) this runner does not compute."""


@attrs.frozen
class RopeScaling:
    """RoPE frequency scaling as Hugging Face's Llama defines it (``linear`` or ``llama3``)."""

    kind: str = attrs.field(validator=attrs.validators.in_(("linear", "llama3")))
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


def check_tensors(where: Path, config: LlamaConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`CheckpointError` naming the first missing, misshapen or unknown weight."""
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        if name not in tensors:
            raise CheckpointError(f"{where}: weight {name!r} is missing")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{where}: weight {name!r} has shape {tuple(tensors[name].shape)}, "
                f"the config says {shape}")
    extra = sorted(set(tensors) - set(shapes) - {"rope_freqs"})
    if extra:
        raise UnsupportedCheckpoint(
            f"{where}: weights this Llama runner does not compute: {extra[:5]}")


def fingerprint(config: LlamaConfig, tensors: Mapping[str, torch.Tensor]) -> str:
    """A short digest of the config and a sample of every weight: two pools that exchange KV
    must come from the same model, and this names it."""
    digest = hashlib.sha256(repr(attrs.astuple(config)).encode())
    for name in sorted(tensors):
        flat = tensors[name].detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        digest.update(name.encode())
        digest.update(flat[::step].to(torch.float32).numpy().tobytes())
    return digest.hexdigest()[:16]


def refuse_architecture(where: Path, architecture: object) -> None:
    if architecture not in LLAMA_ARCHITECTURES:
        raise UnsupportedCheckpoint(
            f"{where}: the checkpoint's architecture is {architecture!r}; pdlife's runner "
            f"computes Llama-family checkpoints ({', '.join(sorted(LLAMA_ARCHITECTURES))})")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """A GGUF file or a Hugging Face directory (``config.json`` + ``*.safetensors``)."""
    where = Path(path)
    if where.is_dir():
        return _load_hf_directory(where)
    if where.is_file() and where.suffix == ".gguf":
        from scheduler.model.gguf_checkpoint import load_gguf

        return load_gguf(where)
    if where.is_file():
        raise CheckpointError(f"{where}: not a .gguf file nor a directory with config.json")
    raise CheckpointError(f"{where}: no such file or directory")


def _hf_config(where: Path, raw: Mapping[str, Any]) -> LlamaConfig:
    refuse_architecture(where, raw.get("model_type"))
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise UnsupportedCheckpoint(f"{where}: {flag}=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"{where}: hidden_act {raw['hidden_act']!r} is not silu")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {})
    rope_theta = float(raw.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden=hidden,
        layers=int(raw["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate=int(raw["intermediate_size"]),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=hf_rope_scaling(where, scaling),
    )


def hf_rope_scaling(where: Path, raw: Mapping[str, Any]) -> RopeScaling | None:
    """Hugging Face's ``rope_scaling`` (or 5.x ``rope_parameters``) as a :class:`RopeScaling`."""
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3", float(raw["factor"]), float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedCheckpoint(f"{where}: RoPE scaling {kind!r} is not supported")


def _load_hf_directory(where: Path) -> Checkpoint:
    from safetensors.torch import load_file

    config_file = where / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{where}: no config.json (a Hugging Face directory needs one)")
    config = _hf_config(where, json.loads(config_file.read_text()))
    files = sorted(where.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{where}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            tensors[_hf_name(where, name)] = tensor.to(torch.float32)
    if config.tie_word_embeddings:
        tensors.pop("lm_head", None)
    check_tensors(where, config, tensors)
    return Checkpoint(
        name=where.name, path=where, format="safetensors", config=config, tensors=tensors,
        tokenizer=TokenizerSource(directory=where), fingerprint=fingerprint(config, tensors),
    )


def _hf_name(where: Path, name: str) -> str:
    base = name.removesuffix(".weight")
    if base == "model.embed_tokens":
        return "embed"
    if base == "model.norm":
        return "norm"
    if base == "lm_head":
        return "lm_head"
    parts = base.split(".", 3)
    layer = len(parts) == 4 and parts[:2] == ["model", "layers"]
    if layer and parts[3] in _HF_LAYER_NAMES and name.endswith(".weight"):
        return f"layers.{parts[2]}.{_HF_LAYER_NAMES[parts[3]]}"
    raise UnsupportedCheckpoint(f"{where}: tensor {name!r} is not part of a Llama decoder")


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
