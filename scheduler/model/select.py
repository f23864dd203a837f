"""Model selection: the one function that turns ``--model`` into a model, its runner and tokenizer.

``reference`` is the fixed-point reference model with the byte tokenizer (exact; the fuzzers'
and most tests' model); a shipped name (``smollm2``, :mod:`scheduler.model.shipped`) or a path
(a ``.gguf`` file or a Hugging Face directory) is a real checkpoint on the Llama runner. The
CLI, the service, the demo and the benchmarks all call :func:`load_model`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from kv.pool import KVPool
from kv.pool_layout import KVLayout
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import (
    LlamaModel,
    ModelConfig,
    PagedModelRunner,
    ReferenceModel,
    resolve_device,
)
from scheduler.runner import ModelRunner

REFERENCE = "reference"

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What serving asks of a tokenizer (the byte tokenizer and :class:`ChatTokenizer`)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@attrs.frozen(eq=False)
class ServedModel:
    """A loaded model and everything serving needs around it."""

    name: str
    model: Any  # has make_pool(num_pages=, page_size=)
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_position: int
    fingerprint: str
    kv_bytes_per_token: int
    is_reference: bool

    def make_pool(self, *, num_pages: int, page_size: int,
                  layout: KVLayout = KVLayout.LAYER_MAJOR) -> KVPool:
        pool: KVPool = self.model.make_pool(num_pages=num_pages, page_size=page_size,
                                            layout=layout)
        return pool

    def shard(self, mesh: Any, device: str | torch.device) -> Any:
        """This rank's part of the model on ``mesh`` (a :class:`scheduler.model.sharded.Mesh`):
        the reference model's TP x PP shard, or a real checkpoint's TP shard."""
        if self.is_reference:
            from scheduler.model.sharded import ShardedLlama

            return ShardedLlama(self.model.config, mesh, device)
        from scheduler.model.sharded_checkpoint import ShardedRealModel

        if isinstance(self.model, ShardedRealModel) and self.model.mesh == mesh:
            return self.model  # loaded as this rank's part (load_model's mesh=)
        if not self.model.checkpoint.tensors:
            raise RuntimeError(f"{self.name}: the checkpoint's tensors were released "
                               "(release_checkpoint): shard before releasing them")
        return ShardedRealModel(self.model.checkpoint, mesh, dtype=self.model.dtype,
                                device=device, eos_token_ids=self.eos_token_ids, name=self.name)

    def release_checkpoint(self) -> None:
        """Let the checkpoint's tensors go, keeping its configuration: the model holds weights
        of its own (fused, transposed, in its dtype), so the tensors it was built from are a
        second copy (about 400 MB of SmolLM2's 513 MB in float32, all of it in bfloat16). For
        a process that builds nothing more from them (:meth:`shard` needs them); the reference
        model has none."""
        checkpoint = getattr(self.model, "checkpoint", None)
        if checkpoint is not None and checkpoint.tensors:
            self.model.checkpoint = attrs.evolve(checkpoint, tensors={})

    def release_weights(self) -> None:
        """Let the loaded model's weights go (and its checkpoint's), keeping what sizes pools
        and names the model: for a process that serves with a part built from them
        (:meth:`shard`), such as a TP prefill's rank 0. The reference model's stay (they are
        a few KiB and :meth:`shard` builds its parts from its configuration)."""
        if self.is_reference:
            return
        self.release_checkpoint()
        self.model.release_weights()

    @property
    def source(self) -> tuple[str, str] | None:
        """What another process loads this model again from: ``load_model``'s spec and dtype
        (None for the reference model, which a :class:`ModelConfig` shapes)."""
        if self.is_reference:
            return None
        return self.name, str(self.model.dtype).removeprefix("torch.")

    def runner(self, model: Any, pool: KVPool) -> ModelRunner:
        """A runner over ``pool`` (the signature of :data:`scheduler.assemble.RunnerFactory`)."""
        if self.is_reference:
            return PagedModelRunner(model, pool)
        from scheduler.model.llama import LlamaRunner

        return LlamaRunner(model, pool)

    def pages_for(self, budget_bytes: int, page_size: int) -> int:
        """Pages of ``page_size`` tokens that fit a KV budget of ``budget_bytes``."""
        pages = budget_bytes // (self.kv_bytes_per_token * page_size)
        if pages < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no page of {page_size} tokens "
                f"({self.kv_bytes_per_token * page_size} bytes per page)")
        return int(pages)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_token_ids: Iterable[int] = (), ignore_eos: bool = False) -> list[int]:
        """The colocated greedy run (what disaggregated serving must equal)."""
        if self.is_reference:
            return ReferenceModel(self.model).generate(
                prompt_ids, max_new_tokens, stop_token_ids, ignore_eos)
        from scheduler.model.llama import generate

        return generate(self.model, prompt_ids, max_new_tokens,
                        stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """``text`` as token ids; with ``chat`` as one user message through the chat template
        (the reference model has none: BOS and the bytes). A conversation (a list of messages)
        goes through :meth:`encode_messages`."""
        if not isinstance(text, str):
            raise TypeError(
                f"encode takes one text (str), got {type(text).__name__}: for a list of chat "
                "messages ({'role': ..., 'content': ...}) call encode_messages(messages)")
        if self.is_reference:
            ids: list[int] = self.tokenizer.encode(text, add_bos=chat)
            return ids
        if chat:
            return list(self.tokenizer.encode_chat([{"role": "user", "content": text}]))
        return list(self.tokenizer.encode(text))

    def encode_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """``messages`` (``[{"role": ..., "content": ...}, ...]``: a system prompt, earlier
        turns) through the chat template, ready for the assistant's answer."""
        if self.is_reference:
            raise ValueError("the reference model has no chat template")
        return list(self.tokenizer.encode_chat(messages))

    def decode(self, ids: Iterable[int]) -> str:
        out: str = self.tokenizer.decode(ids)
        return out

    def stop_text(self, ids: Iterable[int]) -> str:
        """The text stop strings are looked for in: special tokens kept (a stop may be one's
        text, ``<|im_end|>``), as SGLang matches them whatever the request's
        ``skip_special_tokens``. The byte tokenizer's special tokens have no text."""
        if self.is_reference:
            return self.decode(ids)
        out: str = self.tokenizer.decode(ids, skip_special_tokens=False)
        return out


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    reference: ModelConfig | None = None,
    mesh: Any = None,
) -> ServedModel:
    """``reference``, a shipped model's name, or a path to a GGUF file or HF directory (a
    built-in name comes before a path of that name, with a WARNING: ``./smollm2`` is the path).
    With ``mesh`` (a :class:`scheduler.model.sharded.Mesh`), a real checkpoint is built as this
    rank's part only (:meth:`ServedModel.shard` hands it back), never whole."""
    from scheduler.model.shipped import SHIPPED, shipped_path

    if spec in (REFERENCE, *SHIPPED) and Path(spec).exists():
        kind = "directory" if Path(spec).is_dir() else "file"
        logger.warning("model %r: loading the built-in model of that name, not the %s %s (a "
                       "built-in name comes before a path): pass ./%s to load the %s", spec,
                       kind, Path(spec).resolve(), spec, kind)
    if spec == REFERENCE:
        return reference_model(reference or ModelConfig(), device=device)
    from scheduler.model.checkpoint import CheckpointError
    from scheduler.model.hf_tokenizer import load_tokenizer
    from scheduler.model.llama import RealModel
    from scheduler.model.loader import load_checkpoint

    if not spec:
        raise CheckpointError(f"no model named: give {REFERENCE!r}, a shipped model's name "
                              f"({', '.join(sorted(SHIPPED))}) or a checkpoint's path")
    path = shipped_path(spec) if spec in SHIPPED else Path(spec)
    name = spec if spec in SHIPPED else str(path)  # one name for ``dir`` and ``dir/``
    if spec not in SHIPPED and name in (REFERENCE, *SHIPPED):
        name = f"./{name}"  # the path, as ServedModel.source loads it again, not the built-in
    if spec not in SHIPPED and not path.exists():
        raise CheckpointError(f"{spec}: no such file or directory, and not a model pdlife "
                              f"knows by name ({', '.join(sorted((REFERENCE, *SHIPPED)))})")
    checkpoint = load_checkpoint(path)
    try:
        tokenizer = load_tokenizer(checkpoint.tokenizer)
    except CheckpointError as exc:  # named by its file where it has one, else by the model's
        said = str(exc)
        raise type(exc)(said if said.startswith(str(path)) else f"{path}: {said}") from exc
    if tokenizer.vocab_size > checkpoint.config.vocab_size:
        logger.warning("%s: the tokenizer has %d tokens, the model's embedding %d rows: a prompt "
                       "holding one of the last %d is refused (token ids beyond the vocabulary)",
                       path, tokenizer.vocab_size, checkpoint.config.vocab_size,
                       tokenizer.vocab_size - checkpoint.config.vocab_size)
    if mesh is None:
        model = RealModel(checkpoint, dtype=dtype, device=device,
                          eos_token_ids=tokenizer.eos_token_ids, name=name)
    else:
        from scheduler.model.sharded_checkpoint import ShardedRealModel

        model = ShardedRealModel(checkpoint, mesh, dtype=dtype, device=device,
                                 eos_token_ids=tokenizer.eos_token_ids, name=name)
    return ServedModel(
        name=name, model=model, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids,
        vocab_size=checkpoint.config.vocab_size, max_position=checkpoint.config.max_position,
        fingerprint=model.fingerprint,
        kv_bytes_per_token=model.kv_bytes_per_token, is_reference=False,
    )


def reference_kv_bytes_per_token(config: ModelConfig) -> int:
    """A token's K and V in the pool of the reference model of ``config``: its full-attention
    layers' (a hybrid model keeps the others elsewhere)."""
    return len(config.full_layers) * 2 * config.kv_heads * config.head_dim * (
        torch.finfo(config.dtype).bits // 8)


def reference_model(config: ModelConfig, *, device: str | torch.device = "cpu") -> ServedModel:
    """The fixed-point reference model of ``config`` with its byte tokenizer."""
    model = LlamaModel(config, device=resolve_device(device))
    per_token = reference_kv_bytes_per_token(config)
    return ServedModel(
        name=REFERENCE, model=model, tokenizer=ByteTokenizer(),
        eos_token_ids=(config.eos_token_id,), vocab_size=config.vocab_size,
        max_position=config.max_position, fingerprint=model.fingerprint,
        kv_bytes_per_token=per_token, is_reference=True,
    )
