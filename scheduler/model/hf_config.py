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
- A field that changes the computation but not the shapes takes the default of transformers'
  config class for the ``model_type`` (:data:`HF_DEFAULTS`: a Mistral's context is 131,072
  tokens and its sliding window 4,096, a Llama's context 2,048 and no window), where the file
  leaves it out. ``tests/test_model_config.py`` checks the table against the installed
  transformers.
- ``eos_token_id`` (where the decode side stops; :mod:`scheduler.model.hf_tokenizer` reads it
  from ``generation_config.json``, else ``config.json``) is checked in both files: a token id, a
  list of them, or null.
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
    check_in_vocabulary,
    read_json,
    refuse_architecture,
    unsupported_rope_scaling,
)


@attrs.frozen
class HFDefaults:
    """What transformers' config class of one ``model_type`` takes for a field ``config.json``
    leaves out, for the fields pdlife reads that change the computation but not the shapes."""

    config_class: str
    max_position_embeddings: int
    rms_norm_eps: float
    #: None: as many KV heads as attention heads.
    num_key_value_heads: int | None
    #: None: no sliding window.
    sliding_window: int | None
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"


#: transformers 5.x ``LlamaConfig`` and ``MistralConfig`` (checked against the installed one by
#: ``tests/test_model_config.py``).
HF_DEFAULTS: Mapping[str, HFDefaults] = {
    "llama": HFDefaults("LlamaConfig", max_position_embeddings=2048, rms_norm_eps=1e-6,
                        num_key_value_heads=None, sliding_window=None),
    "mistral": HFDefaults("MistralConfig", max_position_embeddings=131072, rms_norm_eps=1e-6,
                          num_key_value_heads=8, sliding_window=4096),
}

_MISSING = object()


def hf_config(where: Path, raw: Mapping[str, Any]) -> LlamaConfig:
    """The :class:`LlamaConfig` of the directory ``where``'s ``config.json`` (parsed: ``raw``);
    :class:`CheckpointError` naming the file and the field where it cannot be read, and
    :class:`UnsupportedCheckpoint` where it describes what the runner does not compute."""
    file = where / "config.json"
    kind = raw.get("model_type")
    defaults = HF_DEFAULTS.get(kind) if isinstance(kind, str) else None
    if defaults is None:
        refuse_architecture(where, kind)  # pdlife computes this one: HF_DEFAULTS lacks it
        raise AssertionError(f"model_type {kind!r} is computed but has no HF_DEFAULTS entry")
    _refuse_other_heads(where, raw.get("architectures"))
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise UnsupportedCheckpoint(f"{where}: a quantized checkpoint ({method}) is not "
                                    "supported; a quantized GGUF file is")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise UnsupportedCheckpoint(f"{where}: {flag}=true is not supported")
    activation = raw.get("hidden_act", defaults.hidden_act)
    if activation != "silu":
        raise UnsupportedCheckpoint(f"{where}: hidden_act {activation!r} is not silu")

    fields = _Fields(file, raw)
    eos_ids = fields.token_ids("eos_token_id")
    heads = fields.integer("num_attention_heads")
    hidden = fields.integer("hidden_size")
    max_position = fields.integer("max_position_embeddings", defaults.max_position_embeddings)
    _refuse_a_sliding_window(where, fields, defaults, max_position)
    rope_theta, rope_scaling = _rope(where, fields, defaults, max_position)
    values: dict[str, Any] = dict(
        vocab_size=fields.integer("vocab_size"),
        hidden=hidden,
        layers=fields.integer("num_hidden_layers"),
        heads=heads,
        kv_heads=fields.integer("num_key_value_heads", defaults.num_key_value_heads or heads,
                                null=heads),
        head_dim=fields.integer("head_dim", hidden // heads, null=hidden // heads),
        intermediate=fields.integer("intermediate_size"),
        rms_eps=fields.number("rms_norm_eps", defaults.rms_norm_eps),
        rope_theta=rope_theta,
        max_position=max_position,
        tie_word_embeddings=fields.flag("tie_word_embeddings", defaults.tie_word_embeddings),
        rope_scaling=rope_scaling,
    )
    check_in_vocabulary(str(file), "eos_token_id", eos_ids, values["vocab_size"])
    try:
        return LlamaConfig(**values)
    except CheckpointError as exc:  # fields that do not fit together (heads and KV heads)
        raise CheckpointError(f"{file}: {exc}") from None


def check_generation_config(where: Path, vocab_size: int) -> None:
    """Refuse the directory ``where``'s ``generation_config.json``, where it has one, if it is
    not a JSON object or its ``eos_token_id`` is not token ids of the model's vocabulary of
    ``vocab_size`` tokens (:class:`CheckpointError` naming the file and the field)."""
    file = where / "generation_config.json"
    if not file.is_file():
        return
    raw = read_json(file)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    eos_ids = _Fields(file, raw).token_ids("eos_token_id")
    check_in_vocabulary(str(file), "eos_token_id", eos_ids, vocab_size)


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

    def token_ids(self, key: str) -> tuple[int, ...]:
        """Token ids: one (an integer >= 0) or a list of them; none where absent or null."""
        value = self.value(key, None, null=None)
        listed = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in listed):
            raise CheckpointError(f"{self.file}: {self.prefix}{key} must be a token id (an "
                                  f"integer >= 0) or a list of them, got {_shown(value)}")
        return tuple(listed)

    def flag(self, key: str, default: bool) -> bool:
        value = self.value(key, default, null=False)  # null reads as false, as in transformers
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.file}: {self.prefix}{key} must be true or false, "
                                  f"got {_shown(value)}")
        return value


def _shown(value: object) -> str:
    """A value of ``config.json`` as the file writes it (``null``, ``"four"``)."""
    return json.dumps(value)


def _refuse_a_sliding_window(where: Path, fields: _Fields, defaults: HFDefaults,
                             context: int) -> None:
    """A Mistral whose sliding window is shorter than its context is refused (the runner
    attends to every earlier position); one without (``sliding_window`` null, the v0.2 and
    later ones, or a window no shorter than the context) computes as a Llama. A Mistral
    ``config.json`` that leaves the field out has ``MistralConfig``'s window of 4,096."""
    if defaults.sliding_window is None:
        return  # the architecture has no window: transformers ignores the field
    if "sliding_window" in fields.raw and fields.raw["sliding_window"] is None:
        return
    window = fields.integer("sliding_window", defaults.sliding_window)
    if window >= context:
        return
    said = "" if "sliding_window" in fields.raw else (
        f" ({defaults.config_class}'s default: config.json gives none)")
    raise UnsupportedCheckpoint(
        f"{where}: a Mistral with a sliding window of {window} tokens{said}, shorter than its "
        f"context of {context}, is not supported; one with sliding_window null computes as a "
        "Llama and is served as one")


def _rope(where: Path, fields: _Fields, defaults: HFDefaults,
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
        theta = fields.number("rope_theta", defaults.rope_theta)
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
