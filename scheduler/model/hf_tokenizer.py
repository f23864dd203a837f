"""A checkpoint's own tokenizer: Hugging Face ``tokenizers``, its special tokens and chat template.

Two sources, one class (:class:`ChatTokenizer`):

- a directory with ``tokenizer.json`` (and ``tokenizer_config.json``, ``chat_template.jinja``
  or ``chat_template.json``, ``generation_config.json``, ``config.json`` when present);
- the ``tokenizer.*`` fields of a GGUF file: a byte-level BPE (``tokenizer.ggml.model`` gpt2)
  is rebuilt from its tokens and merges, its pre-tokenizer as ``tokenizer.ggml.pre`` says (one
  of :data:`GGUF_PRE_TOKENIZERS`; another is refused rather than split the wrong way), or a
  SentencePiece BPE (``llama``) from its pieces and their scores, as transformers reads one;
  tokens marked *control* become special tokens.

A ``LlamaTokenizer`` directory gets the text pipeline transformers (5.x) builds for that class,
whatever its ``tokenizer.json`` says (:func:`_as_transformers_builds`).

The EOS ids (where the decode side stops) are the generation config's ``eos_token_id`` (a
directory's ``generation_config.json``, else its ``config.json``, as transformers' ``generate``
reads them; a GGUF file's EOS, end-of-turn and end-of-message ids) and the tokenizer's own EOS
token.

The chat template is compiled as the tokenizer loads (a template that does not compile is the
checkpoint's error, not a client's) and rendered with jinja2 in a sandbox, with the names
Hugging Face's ``apply_chat_template`` provides (``messages``, ``add_generation_prompt``, the
special tokens, ``raise_exception``, ``strftime_now``, the ``{% generation %}`` block of
training templates, rendered as its body), and the text is encoded without adding BOS again (the
template writes what it wants).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from scheduler.model.checkpoint import CheckpointError, TokenizerSource, read_json

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
#: The ``tokenizer.ggml.pre`` values whose splitting this module rebuilds (``gpt-2``: GPT-2's
#: regex; an absent field, or ``default``, is split the same way, with a warning).
GGUF_PRE_TOKENIZERS = frozenset({"gpt-2", *_SPLITS, *_SINGLE_DIGITS})
#: GGUF's end-of-generation ids besides EOS: end of turn, end of message (llama.cpp's EOG).
_GGUF_EOG = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
             "tokenizer.ggml.eom_token_id")

#: A byte-fallback piece: one byte, ``<0x41>``.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

logger = logging.getLogger(__name__)

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
        # SentencePiece-style vocabularies: pieces spell a space as ``▁``, and (byte fallback)
        # ``<0xNN>`` pieces stand for one byte each, which the decoder groups into characters.
        decoder = tokenizer.decoder
        self.metaspace = decoder is not None and "\u2581" in decoder.__getstate__().decode()
        self.byte_pieces = frozenset(
            i for piece, i in tokenizer.get_vocab(with_added_tokens=False).items()
            if _BYTE_PIECE.fullmatch(piece)) if self.metaspace else frozenset()
        try:
            self._template: Any = None if chat_template is None else _compile(chat_template)
        except TemplateError as exc:
            raise CheckpointError(f"the chat template does not compile: {exc}") from exc

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(token_id) or "")

    def piece_bytes(self, token_id: int) -> bytes | None:
        """The bytes a SentencePiece-style token stands for (``▁`` a space, ``<0xNN>`` its
        byte), or None for another vocabulary's."""
        if not self.metaspace:
            return None
        piece = self.token(token_id)
        if token_id in self.byte_pieces:
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; special tokens written in it are kept whole, and BOS is added
        when the checkpoint says so and ``add_special_tokens``."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        out: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return out

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> str:
        """The chat template rendered for ``messages`` (``[{"role": ..., "content": ...}]``)
        and, as transformers passes them, ``tools`` (OpenAI's tool objects; a template that
        does not read them renders as without)."""
        if self._template is None:
            raise ValueError("this checkpoint has no chat template")
        text: str = self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_token_id), eos_token=self.token(self.eos_token_id),
            tools=None if tools is None else list(tools),
        )
        return text

    def encode_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools)
        return self.encode(text, add_special_tokens=False)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' mark of the assistant's part in
    training templates; rendering it writes its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # transformers' filter, keywords and defaults: templates pass them (GLM's
        # ``tojson(ensure_ascii=False)``).
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def load_tokenizer(source: TokenizerSource) -> ChatTokenizer:
    """The tokenizer a checkpoint names (:attr:`Checkpoint.tokenizer`)."""
    if source.directory is not None:
        return _from_directory(source.directory)
    return from_gguf_fields(source.gguf_fields)


def from_gguf_fields(fields: Mapping[str, Any]) -> ChatTokenizer:
    """The tokenizer a GGUF file's ``tokenizer.*`` fields describe: a byte-level BPE
    (``tokenizer.ggml.model`` gpt2) or a SentencePiece BPE (``llama``)."""
    kind = fields.get("tokenizer.ggml.model")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    if kind == "llama":
        tok = _sentencepiece_bpe(fields, tokens)
    elif kind == "gpt2":
        tok = _byte_level_bpe(fields, tokens)
    else:
        raise CheckpointError(f"GGUF tokenizer {kind!r} is not supported (byte-level BPE, "
                              "'gpt2', and SentencePiece BPE, 'llama', are)")
    types = list(fields.get("tokenizer.ggml.token_type") or ())
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED])
    bos = _gguf_token_id(fields, "tokenizer.ggml.bos_token_id", len(tokens))
    eos_ids = _unique(_gguf_token_id(fields, key, len(tokens)) for key in _GGUF_EOG)
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = fields.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    template = fields.get("tokenizer.chat_template")
    return ChatTokenizer(tok, bos_token_id=bos, eos_token_ids=eos_ids,
                         chat_template=str(template) if template else None)


def _sentencepiece_bpe(fields: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    """A SentencePiece BPE vocabulary as transformers reads it from a GGUF file: its merges, or
    (most files list none) the merges its pieces' scores imply; byte fallback; the text
    pipeline of ``LlamaTokenizer`` (:func:`_as_transformers_builds`)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    listed = fields.get("tokenizer.ggml.merges")
    if listed:
        merges = [tuple(m.split(" ", 1)) for m in listed]
    else:
        merges = _merges_from_scores(vocab, list(fields.get("tokenizer.ggml.scores") or ()))
    unk = _gguf_token_id(fields, "tokenizer.ggml.unknown_token_id", len(tokens))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                               unk_token=None if unk is None else tokens[unk]))
    _as_transformers_builds(tok, {})
    return tok


def _merges_from_scores(vocab: Mapping[str, int], scores: Sequence[float]
                        ) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a piece into two
    pieces of the vocabulary is a merge, ranked by the whole piece's score (higher first), ties
    by the longer left, then the longer right part; the splits of one piece in the order of
    their parts' ids."""
    if len(scores) != len(vocab):
        raise CheckpointError(f"GGUF tokenizer: {len(scores)} scores for {len(vocab)} tokens "
                              "and no merges (tokenizer.ggml.scores)")
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(vocab, scores, strict=True):
        splits = sorted(((piece[:i], piece[i:]) for i in range(1, len(piece))
                         if piece[:i] in vocab and piece[i:] in vocab),
                        key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked += [(float(score), len(left), len(right), left, right) for left, right in splits]
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _byte_level_bpe(fields: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    """A byte-level BPE rebuilt from its tokens and merges, split as ``tokenizer.ggml.pre``
    names."""
    pre = str(fields.get("tokenizer.ggml.pre") or "default")
    if pre == "default":
        logger.warning("the GGUF file names no pre-tokenizer (tokenizer.ggml.pre %r): "
                       "splitting text as GPT-2 does", pre)
        pre = "gpt-2"
    elif pre not in GGUF_PRE_TOKENIZERS:
        raise CheckpointError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported: pdlife splits "
            f"text as {', '.join(sorted(GGUF_PRE_TOKENIZERS))} do, and another would encode "
            "prompts differently from the model's training (serve the Hugging Face directory, "
            "whose tokenizer.json says how)")
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or ()]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _pre_tokenizer(pre: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    steps: list[Any] = []
    if pre in _SPLITS:
        steps.append(pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"))
    if pre in _SINGLE_DIGITS:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level


def _gguf_token_id(fields: Mapping[str, Any], key: str, vocabulary: int) -> int | None:
    """The token id a GGUF field holds (None where the file has none), or a
    :class:`CheckpointError` naming the field when it is not an id of the vocabulary."""
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocabulary:
        raise CheckpointError(f"GGUF tokenizer: {key} must be a token id, an integer in "
                              f"0..{vocabulary - 1}, got {value!r}")
    return value


def _from_directory(where: Path) -> ChatTokenizer:
    file = where / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(
            f"{where}: no tokenizer.json, where pdlife reads a directory's tokenizer from: write "
            "one with transformers, AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) "
            "(it converts a tokenizer.model), or, for a directory without tokenizer files, see "
            "docs/models.md, 'Your own checkpoint'")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise CheckpointError(f"{file}: not a tokenizer the tokenizers library reads, damaged "
                              f"or truncated ({exc})") from exc
    config = _json(where / "tokenizer_config.json")
    if config.get("tokenizer_class") in _METASPACE_CLASSES:
        _as_transformers_builds(tok, config)
    template = config.get("chat_template")
    if (where / "chat_template.jinja").is_file():
        template = (where / "chat_template.jinja").read_text()
    elif (where / "chat_template.json").is_file():
        template = _json(where / "chat_template.json").get("chat_template")
    bos = _token_id(tok, config.get("bos_token"))
    # transformers' generate stops on the generation config's EOS ids: generation_config.json's,
    # else those config.json carries.
    generation = where / "generation_config.json"
    found = _json(generation if generation.is_file() else where / "config.json").get(
        "eos_token_id")
    listed = found if isinstance(found, list) else [found]
    eos_ids = _unique([_token_id(tok, config.get("eos_token")),
                       *(v for v in listed if isinstance(v, int) and not isinstance(v, bool))])
    if not eos_ids:
        logger.warning("%s: no EOS id (generation_config.json, config.json and "
                       "tokenizer_config.json name none): answers end at max_new_tokens or a "
                       "stop the request names", where)
    return ChatTokenizer(tok, bos_token_id=bos, eos_token_ids=eos_ids,
                         chat_template=template if isinstance(template, str) else None)


#: ``tokenizer_class`` values whose text pipeline transformers (5.x) builds itself rather than
#: take from ``tokenizer.json``: SentencePiece-style BPE (Llama 2, TinyLlama, CodeLlama).
_METASPACE_CLASSES = frozenset({"LlamaTokenizer", "LlamaTokenizerFast"})


def _as_transformers_builds(tok: Tokenizer, config: Mapping[str, Any]) -> None:
    """Give ``tok`` the normalizer, pre-tokenizer and decoder transformers' ``LlamaTokenizer``
    builds (whatever ``tokenizer.json`` says): no normalizer; a Metaspace pre-tokenizer whose
    ``▁`` goes before the first word only (``legacy: false``, the default), before every
    piece (``legacy: true``) or never (``add_prefix_space: false``); a decoder that strips the
    one leading space it added. Files written for the older pipeline (a ``Prepend("▁")``
    normalizer) otherwise encode leading spaces and text after a special token differently."""
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)


def _unique(ids: Iterable[int | None]) -> list[int]:
    """``ids`` without None and repeats, in order."""
    return list(dict.fromkeys(i for i in ids if i is not None))


def _json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = read_json(file)
    return data if isinstance(data, dict) else {}


def _token_id(tok: Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    found: int | None = tok.token_to_id(token)
    return found
