"""GGUF files: the config from the metadata, the weights dequantized, the tokenizer's fields.

The ``gguf`` package reads the file and dequantizes every type it supports (F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K .. Q6_K, among others) to float32. GGUF lists a
tensor's shape fastest dimension first; the reader's arrays are already in row-major
``[out_features, in_features]`` order, as torch wants them.

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` within each head,
interleaving the two rotary halves, because llama.cpp rotates adjacent pairs. This runner rotates
halves (Hugging Face's ``rotate_half``), so the loader undoes the permutation: per head, rows
``(head_dim/2, 2)`` become ``(2, head_dim/2)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scheduler.model.checkpoint import (
    Checkpoint,
    CheckpointError,
    LlamaConfig,
    RopeScaling,
    TokenizerSource,
    check_tensors,
    fingerprint,
    refuse_architecture,
    unsupported_rope_scaling,
    unsupported_tensor,
)

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
_GGUF_TOP_NAMES = {
    "token_embd": "embed",
    "output_norm": "norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
}


def load_gguf(where: Path) -> Checkpoint:
    """A GGUF file of a Llama-family model, dequantized to float32."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(where))
    except (ValueError, OSError, IndexError) as exc:  # IndexError: the metadata is cut short
        raise CheckpointError(f"{where}: not a readable GGUF file (damaged or truncated?): "
                              f"{type(exc).__name__}: {exc}") from exc
    meta = _metadata(reader)
    architecture = meta.get("general.architecture")
    refuse_architecture(where, architecture)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = _config(where, str(architecture), meta, tied)
    tensors = _tensors(where, reader, config)
    check_tensors(where, config, tensors, _gguf_native)
    tokenizer_fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    if not tokenizer_fields.get("tokenizer.ggml.tokens"):
        raise CheckpointError(f"{where}: the file carries no tokenizer (tokenizer.ggml.tokens)")
    return Checkpoint(
        name=str(meta.get("general.name") or where.stem), path=where, format="gguf",
        config=config, tensors=tensors, tokenizer=TokenizerSource(gguf_fields=tokenizer_fields),
        fingerprint=fingerprint(config, tensors),
    )


def _metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _config(where: Path, arch: str, meta: Mapping[str, Any], tied: bool) -> LlamaConfig:
    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{where}: metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(meta.get(f"{arch}.attention.key_length")
                   or meta.get(f"{arch}.rope.dimension_count") or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden=hidden,
        layers=int(need("block_count")),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(need("feed_forward_length")),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        max_position=int(need("context_length")),
        tie_word_embeddings=tied,
        rope_scaling=_rope_scaling(where, arch, meta),
    )


def _rope_scaling(where: Path, arch: str, meta: Mapping[str, Any]) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(meta[f"{arch}.rope.scaling.factor"]))
    raise unsupported_rope_scaling(where, kind)


def _tensors(where: Path, reader: Any, config: LlamaConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _name(where, t.name)
        shape = tuple(int(d) for d in reversed(t.shape))
        data = dequantize(t.data, t.tensor_type)
        if data.size != int(np.prod(shape)):
            raise CheckpointError(f"{where}: tensor {t.name!r} holds {data.size} of its "
                                  f"{int(np.prod(shape))} values: the file is truncated")
        array = np.array(data, dtype=np.float32).reshape(shape)
        tensor = torch.from_numpy(array)
        if name.endswith(".q"):
            tensor = unpermute_rotary_rows(tensor, config.heads)
        elif name.endswith(".k"):
            tensor = unpermute_rotary_rows(tensor, config.kv_heads)
        tensors[name] = tensor
    return tensors


def _gguf_native(name: str) -> str:
    """The GGUF name of the runner's weight ``name`` (the inverse of :func:`_name`)."""
    top = {v: k for k, v in _GGUF_TOP_NAMES.items()}
    if name in top:
        return f"{top[name]}.weight"
    _, layer, part = name.split(".")
    gguf_part = next(k for k, v in _GGUF_LAYER_NAMES.items() if v == part)
    return f"blk.{layer}.{gguf_part}.weight"


def _name(where: Path, gguf_name: str) -> str:
    base = gguf_name.removesuffix(".weight")
    if base in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[base]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    raise unsupported_tensor(where, gguf_name)


def unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the rotary halves of a Q or K projection."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape).contiguous()


def permute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permutation (the inverse of :func:`unpermute_rotary_rows`), for writers."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape).contiguous()
