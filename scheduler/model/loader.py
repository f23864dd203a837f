"""Loading a checkpoint, whatever its format: a GGUF file or a Hugging Face directory.

:func:`load_checkpoint` dispatches on the path; the GGUF reader is
:mod:`scheduler.model.gguf_checkpoint`, the Hugging Face directory (``config.json`` and every
``*.safetensors`` file) is read here, its ``config.json`` by :mod:`scheduler.model.hf_config`. Both
give a :class:`~scheduler.model.checkpoint.Checkpoint`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import torch

from scheduler.model.checkpoint import (
    Checkpoint,
    CheckpointError,
    LlamaConfig,
    TokenizerSource,
    UnsupportedCheckpoint,
    WeightDigest,
    check_tensors,
    read_json,
    unsupported_tensor,
)
from scheduler.model.gguf_checkpoint import load_gguf
from scheduler.model.hf_config import check_generation_config, hf_config

logger = logging.getLogger(__name__)

#: Tensors of older checkpoints that are buffers, not weights (transformers ignores them too).
_HF_IGNORED = ("rotary_emb.inv_freq",)

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


def load_checkpoint(path: str | Path) -> Checkpoint:
    """A GGUF file or a Hugging Face directory (``config.json`` + ``*.safetensors``)."""
    where = Path(path)
    if where.is_dir():
        return _load_hf_directory(where)
    if where.is_file() and where.suffix == ".gguf":
        return load_gguf(where)
    if where.is_file():
        raise CheckpointError(f"{where}: not a .gguf file nor a directory with config.json")
    raise CheckpointError(f"{where}: no such file or directory")


def _load_hf_directory(where: Path) -> Checkpoint:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_file = where / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{where}: no config.json (a Hugging Face directory needs one)")
    raw = read_json(config_file)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: not a JSON object")
    config = hf_config(where, raw)
    check_generation_config(where, config.vocab_size)
    tensors: dict[str, torch.Tensor] = {}
    held_by: dict[str, Path] = {}  # the file each weight came from
    digest = WeightDigest()
    for file in _safetensors_files(where):
        try:
            held = load_file(str(file))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file, damaged or "
                                  f"truncated ({exc})") from exc
        for name, tensor in held.items():
            if name.endswith(_HF_IGNORED):
                continue
            if not tensor.is_floating_point():
                raise UnsupportedCheckpoint(
                    f"{file}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}: "
                    "pdlife reads float weights (quantized safetensors are not supported; "
                    "a quantized GGUF file is)")
            ours = _hf_name(file, name)
            if ours in held_by:  # which copy a reader takes is up to the order it reads
                raise CheckpointError(
                    f"{where}: tensor {name!r} is in two files, {held_by[ours].name} and "
                    f"{file.name}: keep one copy of it")
            held_by[ours] = file
            kind = str(tensor.dtype).removeprefix("torch.")
            digest.add(name, kind, tensor.shape, tensor.reshape(-1).view(torch.uint8).numpy())
            tensors[ours] = tensor.to(torch.float32)
    config = _tie_as_transformers_does(where, config, tensors)
    check_tensors(where, config, tensors, _hf_native)
    return Checkpoint(
        name=where.name, path=where, format="safetensors", config=config, tensors=tensors,
        tokenizer=TokenizerSource(directory=where), fingerprint=digest.fingerprint(config),
    )


def _tie_as_transformers_does(where: Path, config: LlamaConfig,
                              tensors: dict[str, torch.Tensor]) -> LlamaConfig:
    """The config, untied where it ties the output head to the embeddings but the files hold an
    ``lm_head.weight`` that differs from them: transformers (5.x) then uses the file's head
    ("both are present in the checkpoints with different values, so we will NOT tie them"), and
    so does pdlife. An ``lm_head.weight`` equal to the embeddings is dropped (tied either way)."""
    head = tensors.get("lm_head")
    if not config.tie_word_embeddings or head is None:
        return config
    embed = tensors.get("embed")
    if embed is not None and torch.equal(head, embed):
        del tensors["lm_head"]
        return config
    logger.warning("%s: config.json ties the output head to the embeddings "
                   "(tie_word_embeddings), but the files hold an lm_head.weight that differs from "
                   "them: that head is used, as transformers uses it (set tie_word_embeddings to "
                   "false in config.json to say so)", where)
    return attrs.evolve(config, tie_word_embeddings=False)


def _safetensors_files(where: Path) -> list[Path]:
    """The weight files: those ``model.safetensors.index.json`` maps (where there is one; other
    ``*.safetensors`` files beside them, such as a ``consolidated.safetensors`` copy, are not
    read), else every ``*.safetensors`` file."""
    index = where / "model.safetensors.index.json"
    if not index.is_file():
        files = sorted(where.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{where}: no *.safetensors files{_convert_hint(where)}")
        return files
    listing = read_json(index)
    weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map")
    files = [where / str(name) for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index}: names files that are missing: {missing[:5]}")
    return files


def _convert_hint(where: Path) -> str:
    """What to do with a directory of PyTorch pickles (``pytorch_model.bin``): convert it."""
    pickles = sorted(p.name for p in where.glob("pytorch_model*.bin"))
    if not pickles:
        return ""
    return (f"; it holds {', '.join(pickles[:3])}{', ...' if len(pickles) > 3 else ''}, and "
            "pdlife reads safetensors or GGUF, not PyTorch pickles: convert it with transformers, "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR) (transformers 5 "
            "writes safetensors; 4.x needs safe_serialization=True)")


def _hf_native(name: str) -> str:
    """The Hugging Face name of the runner's weight ``name`` (the inverse of :func:`_hf_name`)."""
    top = {"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
    if name in top:
        return f"{top[name]}.weight"
    _, layer, part = name.split(".")
    hf = next(k for k, v in _HF_LAYER_NAMES.items() if v == part)
    return f"model.layers.{layer}.{hf}.weight"


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
    raise unsupported_tensor(where, name)
