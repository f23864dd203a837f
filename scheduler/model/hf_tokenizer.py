"""A checkpoint's own tokenizer: Hugging Face ``tokenizers``, its special tokens and chat template.

Two sources, one class (:class:`ChatTokenizer`):

- a directory with ``tokenizer.json`` (and ``tokenizer_config.json``, ``chat_template.jinja``,
  ``generation_config.json`` when present);
- the ``tokenizer.*`` fields of a GGUF file: a byte-level BPE (``tokenizer.ggml.model`` gpt2)
  is rebuilt from its tokens and merges, tokens marked *control* become special tokens, and the
  pre-tokenizer follows ``tokenizer.ggml.pre``.

The chat template is rendered with jinja2 in a sandbox, with the names Hugging Face's
``apply_chat_template`` provides (``messages``, ``add_generation_prompt``, the special tokens,
``raise_exception``, ``strftime_now``), and the text is encoded without adding BOS again (the
template writes what it wants).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from scheduler.model.checkpoint import CheckpointError, TokenizerSource

#: ``tokenizer.ggml.token_type`` of a control token (llama.cpp's ``LLAMA_TOKEN_TYPE_CONTROL``).
_CONTROL = 3
_USER_DEFINED = 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Pre-tokenizers that split differently from GPT-2's regex, by ``tokenizer.ggml.pre``.
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
#: Vocabularies trained on single digits (``smollm``: each digit is its own token).
_SINGLE_DIGITS = frozenset({"smollm"})

Message = Mapping[str, Any]


class ChatTokenizer:
    """Text to token ids and back, the special token ids, and the chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template: Any = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(token_id) or "")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; special tokens written in it are kept whole, and BOS is added
        when the checkpoint says so and ``add_special_tokens``."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        out: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return out

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template rendered for ``messages`` (``[{"role": ..., "content": ...}]``)."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text: str = self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_token_id), eos_token=self.token(self.eos_token_id),
        )
        return text

    def encode_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def load_tokenizer(source: TokenizerSource) -> ChatTokenizer:
    """The tokenizer a checkpoint names (:attr:`Checkpoint.tokenizer`)."""
    if source.directory is not None:
        return _from_directory(source.directory)
    return from_gguf_fields(source.gguf_fields)


def from_gguf_fields(fields: Mapping[str, Any]) -> ChatTokenizer:
    """A byte-level BPE tokenizer rebuilt from a GGUF file's ``tokenizer.*`` fields."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"GGUF tokenizer {kind!r} is not supported (byte-level BPE, 'gpt2', is)")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or ()]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(str(fields.get("tokenizer.ggml.pre", "")))
    tok.decoder = decoders.ByteLevel()
    types = list(fields.get("tokenizer.ggml.token_type") or ())
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED])
    bos = _int_or_none(fields.get("tokenizer.ggml.bos_token_id"))
    eos = _int_or_none(fields.get("tokenizer.ggml.eos_token_id"))
    if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    template = fields.get("tokenizer.chat_template")
    return ChatTokenizer(tok, bos_token_id=bos, eos_token_ids=() if eos is None else (eos,),
                         chat_template=str(template) if template else None)


def _pre_tokenizer(pre: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    steps: list[Any] = []
    if pre in _SPLITS:
        steps.append(pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"))
    if pre in _SINGLE_DIGITS:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _from_directory(where: Path) -> ChatTokenizer:
    file = where / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{where}: no tokenizer.json")
    tok = Tokenizer.from_file(str(file))
    config = _json(where / "tokenizer_config.json")
    template = config.get("chat_template")
    if (where / "chat_template.jinja").is_file():
        template = (where / "chat_template.jinja").read_text()
    bos = _token_id(tok, config.get("bos_token"))
    eos_ids: list[int] = []
    generation = _json(where / "generation_config.json").get("eos_token_id")
    for value in generation if isinstance(generation, list) else [generation]:
        if isinstance(value, int):
            eos_ids.append(value)
    eos = _token_id(tok, config.get("eos_token"))
    if eos is not None and eos not in eos_ids:
        eos_ids.insert(0, eos)
    return ChatTokenizer(tok, bos_token_id=bos, eos_token_ids=eos_ids,
                         chat_template=template if isinstance(template, str) else None)


def _json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    return data if isinstance(data, dict) else {}


def _token_id(tok: Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    found: int | None = tok.token_to_id(token)
    return found
