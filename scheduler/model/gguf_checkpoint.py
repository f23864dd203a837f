"""GGUF files: the config from the metadata, the weights dequantized, the tokenizer's fields.

pdlife's own reader (:mod:`scheduler.model.gguf_file`, memory-mapped) reads the file, and every
type the ``gguf`` package dequantizes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
K-quants Q2_K .. Q6_K, among others) is dequantized to float32, as ``gguf`` computes it (Q4_1
and Q8_0 by the reader's module, over whole tensors; the others by ``gguf``). GGUF lists a
tensor's shape fastest dimension first; the reader gives it row-major, ``[out_features,
in_features]``, as torch wants it.

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` within each head,
interleaving the two rotary halves, because llama.cpp rotates adjacent pairs. This runner rotates
halves (Hugging Face's ``rotate_half``), so the loader undoes the permutation: per head, rows
``(head_dim/2, 2)`` become ``(2, head_dim/2)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    UnsupportedCheckpoint,
    WeightDigest,
    check_in_vocabulary,
    check_tensors,
    refuse_architecture,
    unsupported_rope_scaling,
    unsupported_tensor,
)
from scheduler.model.gguf_file import GGUFFileError, GGUFTensor, dequantize, read_gguf

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

#: The metadata field of the EOS id (the tokenizer reads its other end-of-generation ids).
_EOS = "tokenizer.ggml.eos_token_id"


def load_gguf(where: Path) -> Checkpoint:
    """A GGUF file of a Llama-family model, dequantized to float32."""
    try:
        gguf_file = read_gguf(where)
    except GGUFFileError as exc:
        raise CheckpointError(f"{where}: not a readable GGUF file (damaged or truncated?): "
                              f"{exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"{where}: not a readable GGUF file: {type(exc).__name__}: "
                              f"{exc}") from exc
    meta = gguf_file.metadata
    architecture = meta.get("general.architecture")
    refuse_architecture(where, architecture)
    tied = not any(t.name == "output.weight" for t in gguf_file.tensors)
    config = _config(where, str(architecture), meta, tied)
    eos = meta.get(_EOS)  # its type is checked with the tokenizer's, against the tokens
    if isinstance(eos, int) and not isinstance(eos, bool):
        check_in_vocabulary(str(where), f"metadata {_EOS}", (eos,), config.vocab_size)
    digest = WeightDigest()
    tensors = _tensors(where, gguf_file.tensors, config, digest)
    check_tensors(where, config, tensors, _gguf_native)
    tokenizer_fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    if not tokenizer_fields.get("tokenizer.ggml.tokens"):
        raise CheckpointError(f"{where}: the file carries no tokenizer (tokenizer.ggml.tokens)")
    return Checkpoint(
        name=str(meta.get("general.name") or where.stem), path=where, format="gguf",
        config=config, tensors=tensors, tokenizer=TokenizerSource(gguf_fields=tokenizer_fields),
        fingerprint=digest.fingerprint(config),
    )


_MISSING = object()


def _config(where: Path, arch: str, meta: Mapping[str, Any], tied: bool) -> LlamaConfig:
    def read(key: str, kind: type[int] | type[float], default: Any = _MISSING) -> Any:
        """The metadata ``{arch}.{key}``, a positive ``kind``; ``default`` where it is absent
        (refused as missing where not given)."""
        name = f"{arch}.{key}"
        value = meta.get(name)
        if value is None:
            if default is _MISSING:
                raise CheckpointError(f"{where}: metadata {name} is missing")
            return default
        if isinstance(value, list):
            raise CheckpointError(f"{where}: metadata {name} is a per-layer array "
                                  f"({value[:8]}{' ...' if len(value) > 8 else ''}); pdlife's "
                                  "runner takes one value for every layer")
        kinds = (int,) if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
            what = "integer" if kind is int else "number"
            raise CheckpointError(f"{where}: metadata {name} must be a positive {what}, "
                                  f"got {value!r}")
        return kind(value)

    hidden, heads = read("embedding_length", int), read("attention.head_count", int)
    # As llama.cpp reads them: the head dim is key_length (else hidden / heads), and RoPE turns
    # rope.dimension_count of its dimensions (else all of them).
    head_dim = read("attention.key_length", int, hidden // heads)
    for key in ("rope.dimension_count", "attention.value_length"):
        if read(key, int, head_dim) != head_dim:
            what = ("partial rotary embeddings (RoPE on part of each head) are"
                    if key.startswith("rope") else "values of another size than keys are")
            raise UnsupportedCheckpoint(
                f"{where}: metadata {arch}.{key} is {read(key, int)}, the head dim {head_dim} "
                f"({arch}.attention.key_length, else embedding_length / head_count): {what} "
                "not supported")
    values: dict[str, Any] = dict(
        vocab_size=read("vocab_size", int,
                        len(meta.get("tokenizer.ggml.tokens") or ()) or _MISSING),
        hidden=hidden,
        layers=read("block_count", int),
        heads=heads,
        kv_heads=read("attention.head_count_kv", int, heads),
        head_dim=head_dim,
        intermediate=read("feed_forward_length", int),
        rms_eps=read("attention.layer_norm_rms_epsilon", float),
        rope_theta=read("rope.freq_base", float, 10000.0),
        max_position=read("context_length", int),
        tie_word_embeddings=tied,
        rope_scaling=_rope_scaling(where, arch, meta),
    )
    try:
        return LlamaConfig(**values)
    except CheckpointError as exc:  # values that do not fit together (heads and KV heads)
        raise CheckpointError(f"{where}: {exc}") from None


def _rope_scaling(where: Path, arch: str, meta: Mapping[str, Any]) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            said = "missing" if factor is None else f"{factor!r}, not a positive number"
            raise CheckpointError(f"{where}: metadata {arch}.rope.scaling.type is linear and "
                                  f"{arch}.rope.scaling.factor is {said}")
        return RopeScaling("linear", float(factor))
    raise unsupported_rope_scaling(where, kind)


def _tensors(where: Path, file_tensors: Sequence[GGUFTensor], config: LlamaConfig,
             digest: WeightDigest) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for t in file_tensors:
        name, shape = _name(where, t.name), t.shape
        digest.add(t.name, t.tensor_type.name, shape, t.data)  # the file's bytes, as mapped
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError:  # F64 and the integer types, among others
            raise UnsupportedCheckpoint(
                f"{where}: tensor {t.name!r} is {t.tensor_type.name}, a type the gguf package "
                "does not dequantize (pdlife reads F32, F16, BF16 and the quantized types it "
                "does: Q4_0 ... Q8_0, the K-quants)") from None
        array = np.asarray(data, dtype=np.float32)
        if not array.flags.writeable:  # a view of the mapped file (F32): the tensor owns a copy
            array = array.copy()
        tensor = torch.from_numpy(array.reshape(shape))
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
