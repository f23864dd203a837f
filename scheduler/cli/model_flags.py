"""The model flags ``pdlife serve`` and ``pdlife generate`` share, and what they build.

Both commands read ``--model`` and the reference model's shape from the same flags with the same
defaults (:class:`~scheduler.model.reference.ModelConfig`'s), so a served answer and ``pdlife
generate`` agree token for token when started alike.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import attrs

from scheduler.cli.command import UsageError

#: The name ``/model_info`` reports for the reference model when ``--model-name`` is not given.
REFERENCE_NAME = "pdlife-reference-llama"
#: The reference model's shape flags and what each sets (real checkpoints bring their own).
_MODEL_FLAGS = {
    "hidden": "hidden size",
    "layers": "decoder layers",
    "heads": "attention heads",
    "kv_heads": "KV heads (grouped-query attention; divides --heads)",
    "head_dim": "dimension of one head",
    "intermediate": "MLP width",
    "max_position": "longest sequence, prompt and answer together",
    "seed": "seed of its weights",
}


def _model_defaults() -> dict[str, Any]:
    from scheduler.model.reference import ModelConfig

    return {f.name: f.default for f in attrs.fields(ModelConfig) if f.name in _MODEL_FLAGS}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The reference model's shape and seed (ModelConfig's defaults)."""
    group = parser.add_argument_group("model (shared by serve and generate)")
    for name, default in _model_defaults().items():
        group.add_argument(f"--{name.replace('_', '-')}", type=int, default=default,
                           help=f"reference model: {_MODEL_FLAGS[name]} (default: {default})")
    group.add_argument("--device", default="cpu",
                       help="cpu, cuda, cuda:N, or auto (CUDA when available); another name, "
                       "or CUDA where torch has none, is refused (default: cpu)")
    group.add_argument("--model", default="reference", metavar="MODEL",
                       help="reference (the fixed-point model; the flags above shape it), "
                       "smollm2 (SmolLM2-135M-Instruct, shipped), or a path to a .gguf file or "
                       "a Hugging Face directory; a built-in name comes before a directory of "
                       "that name, given as ./smollm2 (default: reference)")
    group.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="a real model's weights and KV cache (default: float32)")


def _check_flags_fit_the_model(args: argparse.Namespace) -> None:
    """A flag that shapes the other kind of model than ``--model`` names is refused: it was
    taken without effect (a real checkpoint brings its shape; the reference model computes in
    fixed point, whatever ``--dtype``)."""
    if args.model == "reference":
        if args.dtype != "float32":
            raise UsageError("--dtype is a real model's: the reference model computes in fixed "
                             "point; drop it, or give --model")
        return
    shaped = [f"--{name.replace('_', '-')}" for name, default in _model_defaults().items()
              if getattr(args, name) != default]
    if shaped:
        many = len(shaped) > 1
        raise UsageError(f"{', '.join(shaped)} {'are' if many else 'is'} the reference model's; "
                         f"--model {args.model} brings its own shape and weights: drop "
                         f"{'them' if many else 'it'}")


def model_config(args: argparse.Namespace) -> Any:
    """The reference model's :class:`~scheduler.model.reference.ModelConfig` the flags give."""
    from scheduler.model.reference import ModelConfig

    _check_flags_fit_the_model(args)
    try:
        return ModelConfig(**{name: getattr(args, name) for name in _MODEL_FLAGS})
    except ValueError as exc:
        raise UsageError(_as_flags(str(exc))) from exc


#: A field of ``ModelConfig`` in its messages: ``ModelConfig.heads`` or a bare ``kv_heads (3)``.
_FIELD = re.compile(r"\bModelConfig\.(\w+)|\b(\w+)(?= \(| must)")


def _as_flags(message: str) -> str:
    """``ModelConfig``'s message with the fields that are flags named as the flags (the
    library's message names its fields, a command line user sets flags)."""

    def flag(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return f"--{name.replace('_', '-')}" if name in _MODEL_FLAGS else match.group(0)

    return _FIELD.sub(flag, message)


def check_device(args: argparse.Namespace) -> None:
    """Refuse a ``--device`` torch does not know, or a CUDA device where it has none."""
    from scheduler.model.decoder import resolve_device

    try:
        resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None


def load_served(args: argparse.Namespace) -> Any:
    """The :class:`~scheduler.model.select.ServedModel` that ``--model`` names."""
    from scheduler.model.checkpoint import CheckpointError
    from scheduler.model.select import load_model
    from scheduler.model.shipped import ShippedModelMissing

    check_device(args)
    try:
        return load_model(args.model, dtype=args.dtype, device=args.device,
                          reference=model_config(args))
    except (CheckpointError, ShippedModelMissing, ValueError) as exc:
        raise UsageError(str(exc)) from exc
