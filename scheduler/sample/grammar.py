"""Structured output with llguidance: a request's grammar as token masks over one vocabulary.

Theory of operation
-------------------
llguidance (a Rust core behind a small Python API) compiles a grammar into a matcher that walks
the tokens of an answer. It sees the model's vocabulary as byte strings, so one
:class:`llguidance.LLTokenizer` is built per model, from the tokenizer's serialised Hugging Face
form (:func:`hf_compiler`) or from a list of token byte strings (:func:`vocabulary_compiler`,
for the reference model's byte tokenizer). Building it takes about 0.2 s for a 49k vocabulary;
compiling a grammar against it about a millisecond, and a mask a few tens of microseconds.

Each :class:`~lifecycle.GrammarKind` becomes llguidance grammar text: a JSON schema (parsed here
first, so a malformed one is named as such), any JSON object (the schema ``{"type": "object"}``),
a regular expression (Rust ``regex`` syntax, matched against the whole answer), or a Lark
grammar (a GBNF one, as llama.cpp and SGLang write them with ``root ::= ...``, is converted to
Lark first). Compiling never half-succeeds: it gives a matcher or raises
:class:`~scheduler.sample.constraint.GrammarError` with llguidance's message.

A server compiles a request's grammar when it admits the request (:meth:`LLGuidanceCompiler.
prepare`, off the event loop; llguidance drops the GIL while it builds), one matcher for each
engine of the process that will run the request, and keeps them until the engines' :meth:`~
LLGuidanceCompiler.compile` takes them: the engine thread, which runs every live request's
forward, does not stall for a compile (0.4-12 ms on SmolLM2's vocabulary). Each matcher serves
one request: copies of one matcher share its lexer's states, and with them the lexer's limits
and memory, so a grammar's history across requests could fail a request that alone runs.

A matcher refuses a token without changing its state (the token is validated before it is
consumed), so a rejected token raises and leaves the matcher as it was. The end of a grammar is
EOS: once the matcher accepts and can take nothing else, :meth:`LLGuidanceConstraint.finished`
is true and the mask holds only the EOS tokens. Whether EOS may come is the mask's to say (a
grammar may name the EOS token itself, ``start: "ok" <|im_end|>``, where llguidance's token
validation refuses it).
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
from collections.abc import Callable, Sequence

import attrs
import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from lifecycle import GrammarKind, GrammarSpec
from scheduler.sample.constraint import GrammarError, GrammarLimitError

#: The first byte llguidance expects of a special token's bytes (it never starts valid UTF-8).
SPECIAL_MARK = b"\xff"
_ANY_OBJECT = '{"type": "object"}'
#: How many matchers compiled ahead a compiler keeps for the engines (the oldest go first: a
#: request refused after admission never takes its own).
PREPARED_LIMIT = 64


@attrs.frozen
class CompileStats:
    """Grammars a compiler compiled: ahead of the engines (``prepared``), by an engine itself
    (``inline``: nothing prepared was waiting), and those that did not compile (``refused``)."""

    prepared: int = 0
    inline: int = 0
    refused: int = 0


class LLGuidanceCompiler:
    """Compiles :class:`~lifecycle.GrammarSpec` into matchers over one model's vocabulary; any
    thread may call it.

    ``vocab_size`` is the model's (its logits' width); when it exceeds the tokenizer's, the
    tokens beyond the tokenizer are never allowed.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, *, vocab_size: int,
                 prepared_limit: int = PREPARED_LIMIT) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if prepared_limit < 0:
            raise ValueError(f"prepared_limit must be >= 0, got {prepared_limit}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.prepared_limit = prepared_limit
        # Fresh matchers by (kind, source), oldest first, for :meth:`compile` to take.
        self._prepared: collections.OrderedDict[tuple[int, tuple[GrammarKind, str]],
                                                llguidance.LLMatcher] = (
            collections.OrderedDict())
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def __repr__(self) -> str:
        return (f"LLGuidanceCompiler(tokenizer_vocab={self.tokenizer.vocab_size}, "
                f"vocab_size={self.vocab_size}, eos={self.tokenizer.eos_tokens}, "
                f"prepared={len(self._prepared)})")

    def check(self, spec: GrammarSpec) -> None:
        """Raises :class:`GrammarError` if ``spec`` does not compile against this vocabulary."""
        check(spec, self.tokenizer)

    def prepare(self, spec: GrammarSpec, matchers: int = 1) -> None:
        """Compile ``spec`` into ``matchers`` fresh matchers for later :meth:`compile` calls to
        take (the engines that will run the request); raises :class:`GrammarError` if it does
        not compile."""
        built = [self._build(spec, "prepared") for _ in range(matchers)]
        key = (spec.kind, spec.source)
        with self._lock:
            for matcher in built:
                self._prepared[(next(self._serial), key)] = matcher
            while len(self._prepared) > self.prepared_limit:
                self._prepared.popitem(last=False)

    def top_up(self, spec: GrammarSpec, matchers: int) -> None:
        """Prepare what ``spec`` lacks of ``matchers`` waiting (a request's samples: they
        share its grammar, checked once)."""
        key = (spec.kind, spec.source)
        with self._lock:
            waiting = sum(k[1] == key for k in self._prepared)
        if matchers > waiting:
            self.prepare(spec, matchers - waiting)

    def compile(self, spec: GrammarSpec) -> LLGuidanceConstraint:
        """A fresh matcher for ``spec`` (one :meth:`prepare` made, when one waits); raises
        :class:`GrammarError` if it does not compile."""
        key = (spec.kind, spec.source)
        with self._lock:
            taken = next((k for k in self._prepared if k[1] == key), None)
            matcher = self._prepared.pop(taken) if taken is not None else None
        if matcher is None:
            matcher = self._build(spec, "inline")
        return LLGuidanceConstraint(matcher, spec.kind, self)

    def _build(self, spec: GrammarSpec, where: str) -> llguidance.LLMatcher:
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
            if matcher.is_error():
                raise GrammarError(_message(spec, matcher.get_error()))
        except GrammarError:
            self._count("refused")
            raise
        self._count(where)
        return matcher

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats = attrs.evolve(self.stats, **{what: getattr(self.stats, what) + 1})


class LLGuidanceConstraint:
    """One request's matcher (a :class:`~scheduler.sample.constraint.Constraint`); one thread
    at a time."""

    def __init__(self, matcher: llguidance.LLMatcher, kind: GrammarKind,
                 compiler: LLGuidanceCompiler) -> None:
        self._matcher = matcher
        self._kind = kind
        self._tokenizer = compiler.tokenizer
        self._vocab_size = compiler.vocab_size
        self._eos = frozenset(compiler.tokenizer.eos_tokens)
        self._bits = np.zeros((compiler.tokenizer.vocab_size + 31) // 32, dtype=np.uint32)
        self._bits_current = False  # ``_bits`` is the mask at the matcher's present state
        self.accepted = 0  # tokens consumed so far

    def __repr__(self) -> str:
        return (f"LLGuidanceConstraint(kind={self._kind.value}, accepted={self.accepted}, "
                f"finished={self.finished()})")

    def allowed(self) -> torch.Tensor:
        """A bool mask of the model's vocabulary size: the tokens the grammar allows next."""
        # llguidance writes its bitmask (bit i of 32-bit word j: token 32j+i, in the machine's
        # byte order, little-endian wherever torch serves) into our buffer; numpy unpacks it,
        # low bit first, into one byte per token, which torch reads as bool without a copy
        # (7 us for 49k tokens; llguidance's byte-per-token mask compared with 0 took 55 us).
        self._compute_mask()
        unpacked = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        mask = torch.from_numpy(unpacked).view(torch.bool)
        if mask.numel() >= self._vocab_size:
            return mask[: self._vocab_size]
        padded = torch.zeros(self._vocab_size, dtype=torch.bool)
        padded[: mask.numel()] = mask
        return padded

    def accept(self, token: int) -> None:
        """Advance past ``token``; a token the grammar does not allow raises
        :class:`GrammarError` and leaves the matcher unchanged."""
        if not 0 <= token < self._tokenizer.vocab_size:
            raise GrammarError(
                f"{self._kind.value} grammar: token {token} is outside the grammar's vocabulary "
                f"0..{self._tokenizer.vocab_size - 1}")
        if token in self._eos:
            # validate_tokens says 0 for EOS where the mask allows it: once the matcher has
            # stopped (EOS is all a stopped, accepting matcher expects), and where the grammar
            # names the EOS token itself (``start: "ok" <|im_end|>``). The mask decides.
            if not self._bits_current:
                self._compute_mask()
            allowed = bool(self._bits[token >> 5] >> np.uint32(token & 31) & np.uint32(1))
        else:
            allowed = self._matcher.validate_tokens([token]) == 1
        if not allowed:
            if not self._bits_current:
                # A grammar that allows nothing here (one that can never be completed, such as
                # a schema that refers only to itself) raises its limit while masking: the
                # request's fault, not a token drawn past the mask.
                self._compute_mask()
            if self._matcher.is_error():
                raise self._limit()
            raise GrammarError(
                f"{self._kind.value} grammar does not allow token {token} "
                f"{self._tokenizer.dbg_tokens([token])} after {self.accepted} tokens")
        self._bits_current = False
        if not self._matcher.consume_token(token):
            raise self._limit()
        self.accepted += 1

    def finished(self) -> bool:
        """Whether the grammar is complete and allows nothing but EOS."""
        m = self._matcher
        return m.is_stopped() and m.is_accepting() and not m.is_error()

    def _compute_mask(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise self._limit()
        self._bits_current = True

    def _limit(self) -> GrammarLimitError:
        """The matcher's own error (a validated token it could not consume, a mask it could not
        compute): llguidance reached one of its limits on this grammar."""
        return GrammarLimitError(f"{self._kind.value} grammar: "
                                 f"{_brief(self._matcher.get_error())}")


def check(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Raises :class:`GrammarError` if ``spec`` does not compile; no matcher is built. Without
    a ``tokenizer`` it checks the grammar alone (what a server checks before admission: about
    a millisecond); a grammar that names special tokens needs the tokenizer to be checked
    fully."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar_text(spec), tokenizer)
    if is_error:
        raise GrammarError(_message(spec, messages[0]))


def hf_compiler(tokenizer: Tokenizer, *, eos_token_ids: Sequence[int],
                vocab_size: int) -> LLGuidanceCompiler:
    """The compiler over a Hugging Face ``tokenizers`` vocabulary (build once per model)."""
    if not eos_token_ids:
        raise ValueError("a grammar needs an EOS token to end on; the tokenizer names none")
    ll = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=list(eos_token_ids))
    return LLGuidanceCompiler(ll, vocab_size=vocab_size)


def vocabulary_compiler(
    tokens: Sequence[bytes],
    *,
    eos_token_id: int,
    special_token_ids: Sequence[int],
    encode: Callable[[bytes], list[int]],
    vocab_size: int,
) -> LLGuidanceCompiler:
    """The compiler over a vocabulary given as each token's bytes (index = token id).

    ``encode`` turns bytes into token ids (llguidance tokenizes forced text with it); the
    bytes of a special token must start with :data:`SPECIAL_MARK`.
    """
    if not 0 <= eos_token_id < len(tokens):
        raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary "
                         f"0..{len(tokens) - 1}")
    unmarked = [i for i in special_token_ids if not tokens[i].startswith(SPECIAL_MARK)]
    if unmarked:
        raise ValueError(f"special tokens {unmarked} must start with {SPECIAL_MARK!r}")
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(
        list(tokens), eos_token_id=eos_token_id, special_token_ids=list(special_token_ids),
        encode=encode))
    ll = llguidance.LLTokenizer(wrapper, eos_token=eos_token_id)
    return LLGuidanceCompiler(ll, vocab_size=vocab_size)


class _Vocabulary:
    """The shape :class:`llguidance.TokenizerWrapper` reads a tokenizer in."""

    bos_token_id = None

    def __init__(self, tokens: list[bytes], *, eos_token_id: int, special_token_ids: list[int],
                 encode: Callable[[bytes], list[int]]) -> None:
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.special_token_ids = special_token_ids
        self._encode = encode

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text)


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar text for ``spec`` (what an ``LLMatcher`` is built from); a source
    that is not even its kind's syntax raises :class:`GrammarError`."""
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:  # llguidance's own message would point into its wrapping of the schema
            json.loads(spec.source)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source)
    if spec.kind is GrammarKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT)
    if spec.kind is GrammarKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind is GrammarKind.EBNF:
        try:
            return llguidance.grammar_from("ebnf", spec.source)
        except ValueError as exc:  # a GBNF grammar that does not convert to Lark
            raise GrammarError(_message(spec, str(exc))) from None
    raise AssertionError(f"unhandled grammar kind {spec.kind!r}")


def _message(spec: GrammarSpec, error: str) -> str:
    return f"{spec.kind.value} does not compile: {_brief(error)}"


def _brief(error: str) -> str:
    """llguidance's error without the matcher's state it appends (a dump of its parser: noise
    to a client, and internals)."""
    return error.strip().split("\n<state>", 1)[0].strip()
