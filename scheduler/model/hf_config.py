"""A Hugging Face ``config.json`` read as transformers (5.x) reads it, into a :class:`LlamaConfig`.

Rules of this file
------------------
- Every value pdlife reads is checked for its type here; a missing or mistyped field is a
  :class:`CheckpointError` naming the file and the field (``config.json: num_hidden_layers is
  missing``), never a ``KeyError`` or ``TypeError`` from deep in the loader.
- The shape fields (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``intermediate_size``) are required: transformers' config classes
  default them to the shape of some other model (``LlamaConfig``'s 32 layers of 4,096), which
  the weights would contradict.
- A field that changes the computation but not the shapes takes its default where the file
  leaves it out: 2,048 positions, an RMSNorm epsilon of 1e-6, as many KV heads as attention
  heads, an untied head.
- RoPE as ``PreTrainedConfig.convert_rope_params_to_dict`` and ``standardize_rope_params``
  read it: ``rope_scaling`` (older files) where it is set, else ``rope_parameters``; the theta
  from that dict first, then the top-level ``rope_theta``, then 10,000; the type from
  ``rope_type``, then ``type``; a ``llama3`` scaling needs ``factor``, ``low_freq_factor`` and
  ``high_freq_factor``, and takes its ``original_max_position_embeddings`` from the top-level
  field first, then the dict's, then ``max_position_embeddings``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from scheduler.model.checkpoint import (
    CheckpointError,
    LlamaConfig,
    RopeScaling,
    UnsupportedCheckpoint,
    refuse_architecture,
    unsupported_rope_scaling,
)

_MISSING = object()


def hf_config(where: Path, raw: Mapping[str, Any]) -> LlamaConfig:
    """The :class:`LlamaConfig` of the directory ``where``'s ``config.json`` (parsed: ``raw``);
    :class:`CheckpointError` naming the file and the field where it cannot be read, and
    :class:`UnsupportedCheckpoint` where it describes what the runner does not compute."""
    file = where / "config.json"
    fields = _Fields(file, raw)
    refuse_architecture(where, _architecture(where, fields))
    _refuse_other_heads(where, raw.get("architectures"))
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise UnsupportedCheckpoint(f"{where}: a quantized checkpoint ({method}) is not "
                                    "supported; a quantized GGUF file is")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise UnsupportedCheckpoint(f"{where}: {flag}=true is not supported")
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedCheckpoint(f"{where}: hidden_act {activation!r} is not silu")
    heads = fields.integer("num_attention_heads")
    hidden = fields.integer("hidden_size")
    max_position = fields.integer("max_position_embeddings", 2048)
    rope_theta, rope_scaling = _rope(where, fields, max_position)
    values: dict[str, Any] = dict(
        vocab_size=fields.integer("vocab_size"),
        hidden=hidden,
        layers=fields.integer("num_hidden_layers"),
        heads=heads,
        kv_heads=fields.integer("num_key_value_heads", heads, null=heads),
        head_dim=fields.integer("head_dim", hidden // heads, null=hidden // heads),
        intermediate=fields.integer("intermediate_size"),
        rms_eps=fields.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position=max_position,
        tie_word_embeddings=fields.flag("tie_word_embeddings", False),
        rope_scaling=rope_scaling,
    )
    try:
        return LlamaConfig(**values)
    except CheckpointError as exc:  # fields that do not fit together (heads and KV heads)
        raise CheckpointError(f"{file}: {exc}") from None


@attrs.frozen
class _Fields:
    """Typed reads of one JSON object: ``prefix`` names it in messages (``rope_parameters.``)."""

    file: Path
    raw: Mapping[str, Any]
    prefix: str = ""

    def value(self, key: str, default: Any = _MISSING, null: Any = _MISSING) -> Any:
        """``raw[key]``; ``default`` where it is absent and ``null`` where it is null (each
        refused as missing where not given)."""
        value = self.raw.get(key, _MISSING)
        if value is None and null is not _MISSING:
            return null
        if value is _MISSING:
            if default is _MISSING:
                raise CheckpointError(f"{self.file}: {self.prefix}{key} is missing")
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, null: Any = _MISSING) -> int:
        value = self.value(key, default, null)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{self.file}: {self.prefix}{key} must be a positive integer, "
                                  f"got {_shown(value)}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise CheckpointError(f"{self.file}: {self.prefix}{key} must be a positive number, "
                                  f"got {_shown(value)}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.value(key, default, null=False)  # null reads as false, as in transformers
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.file}: {self.prefix}{key} must be true or false, "
                                  f"got {_shown(value)}")
        return value


def _shown(value: object) -> str:
    """A value of ``config.json`` as the file writes it (``null``, ``"four"``)."""
    return json.dumps(value)


def _architecture(where: Path, fields: _Fields) -> object:
    """``model_type``, where a Mistral without a sliding window shorter than its context (the
    v0.2 and later ones: ``sliding_window`` null) is the Llama it computes as."""
    kind = fields.raw.get("model_type")
    if kind != "mistral":
        return kind
    window = fields.value("sliding_window", None, null=None)
    context = fields.integer("max_position_embeddings", 2048)
    if window is None or fields.integer("sliding_window") >= context:
        return "llama"
    raise UnsupportedCheckpoint(
        f"{where}: a Mistral with a sliding window of {window} tokens (shorter than its context "
        f"of {context}) is not supported; one with sliding_window null computes as a Llama and "
        "is served as one")


def _rope(where: Path, fields: _Fields,
          max_position: int) -> tuple[float, RopeScaling | None]:
    """RoPE's theta and scaling, read as transformers 5.x reads them (the module's rules)."""
    raw = fields.raw
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(key)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{fields.file}: {key} must be an object or null, got "
                              f"{_shown(params)}")
    rope = _Fields(fields.file, params, f"{key}.")
    if "rope_theta" in params:
        theta = rope.number("rope_theta")
    else:
        theta = fields.number("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", rope.number("factor"))
    if kind == "llama3":
        if "original_max_position_embeddings" in raw:
            original = fields.integer("original_max_position_embeddings")
        else:
            original = rope.integer("original_max_position_embeddings", max_position)
        return theta, RopeScaling(
            "llama3", rope.number("factor"), rope.number("low_freq_factor"),
            rope.number("high_freq_factor"), original)
    raise unsupported_rope_scaling(where, kind)


def _refuse_other_heads(where: Path, architectures: object) -> None:
    """A Llama decoder under another head than a language model's (``architectures``
    ``LlamaForSequenceClassification``, ``LlamaModel``, ...): its weights mean something else."""
    if not isinstance(architectures, list) or not architectures:
        return  # older configs name none; the tensors then say what the checkpoint holds
    if any(str(name).endswith("ForCausalLM") for name in architectures):
        return
    named = " / ".join(str(name) for name in architectures)
    raise UnsupportedCheckpoint(
        f"{where}: the checkpoint is a {named} (config.json's architectures), not a causal "
        "language model; pdlife serves *ForCausalLM checkpoints")
