"""OpenAI's answer shapes: a completion, a chat completion, their streamed chunks, logprobs and
usage, written from a request's :class:`~.config.Answer`.

The text is the one ``/generate`` answers (:func:`~.answers.answer_text`: a matched stop is cut
off unless ``no_stop_trim``). A stream sends only text that cannot change any more: a trailing
incomplete UTF-8 character, a tail that may still become a stop string, and a last token that may
be a stop token are held back until more tokens or the answer come (:class:`StreamText`), so the
chunks add up to exactly the text of the unstreamed answer. A streamed answer's logprobs come
with its chunks (:class:`StreamLogprobs`): a token's with the chunk that sends the last of its
text, the rest (a trimmed stop, text a stop string cut) with the last chunk, so the chunks'
logprobs too add up to the unstreamed answer's (completions' ``text_offset`` counts on).
"""

from __future__ import annotations

import codecs
import functools
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from scheduler.messages import TokenLogprob
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.sample.stops import Stops
from scheduler.service import openai_tools
from scheduler.service.answers import IncrementalText, decode, final_text
from scheduler.service.config import Answer, Item
from scheduler.service.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprobEntry,
    ToolCall,
    TopLogprob,
    Usage,
)

#: What a logprob that is not a number (a token no path can take) is written as: JSON has no
#: infinity, and OpenAI writes -9999.0.
FLOOR_LOGPROB = -9999.0


def now() -> int:
    return int(time.time())


def usage(answers: Sequence[Answer], n: int | None = None) -> Usage:
    """The usage of one request's choices, ``n`` per prompt (default: all of one prompt),
    prompt-major: each prompt counted once, with its cached tokens (its first choice's: they are
    part of its prompt tokens, as OpenAI counts them), and every choice's completion tokens."""
    firsts = answers[::n or len(answers)]
    prompt = sum(a.prompt_tokens for a in firsts)
    completion = sum(len(a.output_ids) for a in answers)
    cached = sum(a.cached_tokens for a in firsts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# -- logprobs -----------------------------------------------------------------------------------


def _number(logprob: float | None) -> float:
    return logprob if logprob is not None and math.isfinite(logprob) else FLOOR_LOGPROB


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet, reversed: printable bytes stand for themselves, the others for
    the characters from U+0100 on, in byte order (GPT-2's table)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(0x100 + shifted)] = byte
            shifted += 1
    return table


def token_bytes(tokenizer: Any, token: int) -> list[int]:
    """The bytes a token stands for (a byte-level or byte-fallback token may be part of a UTF-8
    character; a SentencePiece token's ``▁`` is its space, wherever the token stands)."""
    if isinstance(tokenizer, ByteTokenizer):
        return [token] if token < 256 else []
    own = tokenizer.piece_bytes(token)
    if own is not None:
        return list(own)
    piece: str = tokenizer.token(token)
    table = _byte_of_char()
    if piece and all(ch in table for ch in piece):
        return [table[ch] for ch in piece]
    return list(decode(tokenizer, [token], skip_special_tokens=False).encode())


def _token_text(tokenizer: Any, token: int) -> str:
    """A token's text on its own: its bytes as text, a space a SentencePiece token starts with
    kept (decoding the token alone strips it, as at the start of a text)."""
    if not isinstance(tokenizer, ByteTokenizer):
        own: bytes | None = tokenizer.piece_bytes(token)
        if own is not None:
            return own.decode(errors="replace")
    return decode(tokenizer, [token], skip_special_tokens=False)


class TextOffsets:
    """Where each token's text starts in the answer's text, in characters (completions'
    ``text_offset``), from ``start`` on. A token adds the characters its bytes complete: a
    character split over several tokens counts once, at the token that completes it, and a
    special token the text skips counts nothing, so the offsets index the text the client
    reads."""

    def __init__(self, tokenizer: Any, *, start: int = 0, skip_special_tokens: bool = True,
                 text_start: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chars = start
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # At a text's start (an echoed prompt) a SentencePiece tokenizer's first piece carries
        # a space the text does not have (it was put before the first word to encode it).
        self._strip_space = text_start and getattr(tokenizer, "metaspace", False)

    def of(self, tokens: Iterable[int]) -> list[int]:
        """The offsets of ``tokens``, the next ones of the text."""
        offsets = []
        for token in tokens:
            offsets.append(self.chars)
            if self._skip and not decode(self.tokenizer, [token], skip_special_tokens=True):
                continue  # a special token (or none at all) writes nothing
            text = self._utf8.decode(bytes(token_bytes(self.tokenizer, token)))
            if self._strip_space:
                text, self._strip_space = text.removeprefix(" "), False
            self.chars += len(text)
        return offsets


def completion_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob], top: int,
                        offsets: TextOffsets, *, prompt: bool = False) -> CompletionLogprobs:
    """``/v1/completions`` logprobs: the tokens' texts, logprobs, ``top`` alternatives (by
    text) and text offsets (the next ones of ``offsets``). ``prompt``: the entries are an
    echoed prompt's, whose first token nothing predicts: its logprob and alternatives are null
    (OpenAI's echo)."""
    texts = [_token_text(tokenizer, e.token) for e in entries]
    tops: list[dict[str, float] | None] | None = None
    if top > 0:
        tops = []
        for e in entries:
            alternatives: dict[str, float] = {}
            for tok, lp in e.top[:top]:  # most likely first: it keeps a text two tokens share
                alternatives.setdefault(_token_text(tokenizer, tok), _number(lp))
            tops.append(None if prompt and e.logprob is None else alternatives)
    return CompletionLogprobs(
        tokens=texts, top_logprobs=tops, text_offset=offsets.of(e.token for e in entries),
        token_logprobs=[None if prompt and e.logprob is None else _number(e.logprob)
                        for e in entries])


def echoed_logprobs(tokenizer: Any, item: Item, entries: Sequence[TokenLogprob]
                    ) -> CompletionLogprobs | None:
    """The logprobs of an echoed prompt (its ``entries``, from its first position), or None
    when the request did not ask for logprobs."""
    if not item.sampling.return_logprob:
        return None
    skip = item.options.skip_special_tokens
    offsets = TextOffsets(tokenizer, skip_special_tokens=skip, text_start=True)
    logprobs = completion_logprobs(tokenizer, entries, item.sampling.top_logprobs_num, offsets,
                                   prompt=True)
    if getattr(tokenizer, "metaspace", False):  # the first word's piece: its text has no space
        first = next((i for i, e in enumerate(entries)
                      if decode(tokenizer, [e.token], skip_special_tokens=skip)), None)
        if first is not None:
            logprobs.tokens[first] = logprobs.tokens[first].removeprefix(" ")
    return logprobs


def _joined(first: CompletionLogprobs | None, then: CompletionLogprobs | None
            ) -> CompletionLogprobs | None:
    if first is None or then is None:
        return then
    tops = None if then.top_logprobs is None else [*(first.top_logprobs or ()),
                                                   *then.top_logprobs]
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens, top_logprobs=tops,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        text_offset=first.text_offset + then.text_offset)


def _top(tokenizer: Any, token: int, logprob: float | None) -> TopLogprob:
    return TopLogprob(token=_token_text(tokenizer, token), logprob=_number(logprob),
                      bytes=token_bytes(tokenizer, token))


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob], top: int) -> ChatLogprobs:
    """``/v1/chat/completions`` logprobs: per token its text, logprob, bytes and ``top``
    alternatives."""
    return ChatLogprobs(content=[
        TokenLogprobEntry(**_top(tokenizer, e.token, e.logprob).model_dump(),
                          top_logprobs=[_top(tokenizer, tok, lp) for tok, lp in e.top[:top]])
        for e in entries])


# -- whole answers ------------------------------------------------------------------------------


def answer_logprobs(tokenizer: Any, item: Item, entries: Sequence[TokenLogprob], *,
                    chat: bool, offsets: TextOffsets | None = None
                    ) -> ChatLogprobs | CompletionLogprobs | None:
    """The logprobs of output tokens ``entries`` in the endpoint's shape (completions: text
    offsets from ``offsets``, by default from the answer's start), or None when the request did
    not ask for them."""
    sampling = item.sampling
    if not sampling.return_logprob:
        return None
    if chat:
        return chat_logprobs(tokenizer, entries, sampling.top_logprobs_num)
    if offsets is None:
        offsets = TextOffsets(tokenizer, skip_special_tokens=item.options.skip_special_tokens)
    return completion_logprobs(tokenizer, entries, sampling.top_logprobs_num, offsets)


def answer_body(tokenizer: Any, rid: str, choices: Sequence[tuple[Item, Answer]], model: str,
                *, chat: bool, created: int, n: int | None = None) -> dict[str, Any]:
    """A whole chat completion (``chat``) or completion: one choice per (item, answer), indexed
    in order (``n`` per prompt), and their usage; ``created`` is when the request arrived (Unix
    seconds), as OpenAI stamps it."""
    head: dict[str, Any] = {"id": rid, "created": created, "model": model,
                            "usage": usage([answer for _, answer in choices], n)}
    if chat:
        return ChatCompletionResponse(**head, choices=[
            _chat_choice(tokenizer, i, item, answer) for i, (item, answer) in enumerate(choices)
        ]).model_dump()
    return CompletionResponse(**head, choices=[
        _completion_choice(tokenizer, i, item, answer) for i, (item, answer) in enumerate(choices)
    ]).model_dump()


def _chat_choice(tokenizer: Any, index: int, item: Item, answer: Answer) -> ChatChoice:
    text = final_text(tokenizer, item, answer)
    logprobs = _chat_only(answer_logprobs(tokenizer, item, answer.output_logprobs, chat=True))
    tools = item.options.tools
    if tools is None:
        return ChatChoice(index=index, message=AssistantMessage(content=text, tool_calls=None),
                          logprobs=logprobs, finish_reason=answer.finish_reason)
    read = openai_tools.read(tools, text, answer.finish_reason)
    return ChatChoice(index=index, logprobs=logprobs, finish_reason=read.finish_reason,
                      message=AssistantMessage(content=read.content,
                                               tool_calls=list(read.calls) or None))


def _completion_choice(tokenizer: Any, index: int, item: Item, answer: Answer
                       ) -> CompletionChoice:
    echo = item.options.echo
    prompt = None if echo is None else echoed_logprobs(tokenizer, item, answer.input_logprobs)
    offsets = TextOffsets(tokenizer, start=len(echo or ""),
                          skip_special_tokens=item.options.skip_special_tokens)
    output = _completion_only(answer_logprobs(tokenizer, item, answer.output_logprobs,
                                              chat=False, offsets=offsets))
    return CompletionChoice(index=index, text=(echo or "") + final_text(tokenizer, item, answer),
                            logprobs=_joined(prompt, output), finish_reason=answer.finish_reason)


def _chat_only(logprobs: ChatLogprobs | CompletionLogprobs | None) -> ChatLogprobs | None:
    assert not isinstance(logprobs, CompletionLogprobs)
    return logprobs


def _completion_only(logprobs: ChatLogprobs | CompletionLogprobs | None
                     ) -> CompletionLogprobs | None:
    assert not isinstance(logprobs, ChatLogprobs)
    return logprobs


# -- streams ------------------------------------------------------------------------------------


class StreamText:
    """The text of a streamed answer, sent only once it cannot change (see the module). The
    text of the output's tokens, of all of them or of the first few, is :class:`IncrementalText`'s,
    so a pass decodes the tokens after a settled run, not the whole output again."""

    def __init__(self, tokenizer: Any, item: Item) -> None:
        self.tokenizer = tokenizer
        self.item = item
        self._text = IncrementalText(tokenizer, item)
        self.sent = ""
        trim = not item.options.no_stop_trim
        self._stops = Stops.of(item.sampling) if trim else Stops()
        self._hold_token = trim and bool(item.sampling.stop_token_ids)
        # A trailing run of byte-fallback tokens is one character group still open: a byte that
        # follows can turn the group's text into replacement characters, so it waits.
        self._held: frozenset[int] = getattr(tokenizer, "byte_pieces", frozenset())
        # The leading tokens whose whole text is in ``sent`` (counted when logprobs are asked).
        self.released = 0
        self._within = 0  # the same, within what the client was shown (released_within)
        self._count = item.sampling.return_logprob

    @property
    def ids(self) -> list[int]:
        """The output's tokens so far."""
        return self._text.ids

    def more(self, tokens: Sequence[int]) -> str:
        """The text ``tokens`` add that is safe to send now (maybe empty)."""
        whole = self._text.more(tokens)
        ids = self.ids
        end = max(len(ids) - 1, 0) if self._hold_token else len(ids)
        while end and ids[end - 1] in self._held:
            end -= 1
        text = (whole if end == len(ids) else self._text.upto(end)).rstrip("\ufffd")
        if self._stops:
            text = text[:self._stops.settled(text)]
        delta = self._send(text)
        if delta and self._count:
            self._release()
        return delta

    def _release(self) -> None:
        # The longest run of tokens whose text was all sent (a shorter run may end inside a
        # character, so search from the longest; held back are only the last few).
        self.released = self._longest_within(self.sent, self.released)

    def released_within(self, shown: str) -> int:
        """The leading tokens whose whole text is in ``shown``, the part of ``sent`` the
        client was given (a tool stream holds back what may begin a call); counted when
        logprobs are asked, else 0."""
        if self._count:
            self._within = self._longest_within(shown, self._within)
        return self._within

    def _longest_within(self, shown: str, known: int) -> int:
        """The most leading tokens, ``known`` or more, whose whole text begins ``shown``."""
        for end in range(len(self.ids), known, -1):
            if shown.startswith(self._text.upto(end)):
                return end
        return known

    def rest(self, final: str) -> str:
        """What the answer's ``final`` text adds to what was sent."""
        return self._send(final)

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class StreamLogprobs:
    """The logprobs of a streamed answer, each sent with the chunk that releases its token's
    text (see the module)."""

    def __init__(self, tokenizer: Any, item: Item, *, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.item = item
        self.chat = chat
        self.entries: list[TokenLogprob] = []  # received from the engines
        self.sent = 0
        self._offsets = self._from(0)  # completions: where the next tokens sent start

    def more(self, entries: Sequence[TokenLogprob]) -> None:
        self.entries.extend(entries)

    def echo(self, entries: Sequence[TokenLogprob], text: str) -> CompletionLogprobs | None:
        """The logprobs of an echoed prompt (``entries``, written as ``text``): the output
        tokens' offsets follow that text."""
        self._offsets = self._from(len(text))
        return echoed_logprobs(self.tokenizer, self.item, entries)

    def _from(self, start: int) -> TextOffsets:
        return TextOffsets(self.tokenizer, start=start,
                           skip_special_tokens=self.item.options.skip_special_tokens)

    def upto(self, released: int) -> ChatLogprobs | CompletionLogprobs | None:
        """The logprobs of the tokens before ``released`` not sent yet (a chunk's)."""
        end = max(self.sent, min(released, len(self.entries)))
        return self._send(self.entries[self.sent:end])

    def rest(self, answer: Answer) -> ChatLogprobs | CompletionLogprobs | None:
        """The logprobs of the answer's tokens not sent yet (the last chunk's)."""
        return self._send(answer.output_logprobs[self.sent:])

    def _send(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs | CompletionLogprobs | None:
        logprobs = answer_logprobs(self.tokenizer, self.item, entries, chat=self.chat,
                                   offsets=self._offsets)
        self.sent += len(entries)
        return logprobs


@attrs.frozen
class Chunks:
    """The chunks of one streamed answer, a chat completion's (``chat``) or a completion's:
    request ``rid``'s choice ``index``."""

    rid: str
    model: str
    chat: bool
    index: int = 0
    created: int = attrs.field(factory=now)  # when the request arrived
    # stream_options.include_usage: every chunk has ``usage``, null but in the last.
    include_usage: bool = False

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        usage = {"usage": None} if self.include_usage else {}
        return {"id": self.rid, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, **usage, **extra}

    def opening(self, *, text: bool = True) -> dict[str, Any] | None:
        """A chat stream's first chunk: the assistant's role, and an empty content (null when
        the answer is a forced call, ``text`` false, as in the whole answer)."""
        if not self.chat:
            return None
        return self._chunk([{"index": self.index,
                             "delta": {"role": "assistant", "content": "" if text else None},
                             "finish_reason": None, "logprobs": None}])

    def text(self, delta: str, *, finish: str | None = None,
             logprobs: ChatLogprobs | CompletionLogprobs | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "finish_reason": finish,
                                  "logprobs": None if logprobs is None else logprobs.model_dump()}
        if self.chat:
            choice["delta"] = {"content": delta} if delta else {}
        else:
            choice["text"] = delta
        return self._chunk([choice])

    def tool_calls(self, calls: Sequence[ToolCall]) -> dict[str, Any]:
        """A chat stream's calls, whole, in one chunk (OpenAI's deltas: each call's index,
        id, name and arguments)."""
        return self._chunk([{"index": self.index, "finish_reason": None, "logprobs": None,
                             "delta": {"tool_calls": [
                                 {"index": i, **call.model_dump()}
                                 for i, call in enumerate(calls)]}}])

    def usage(self, answers: Sequence[Answer], n: int) -> dict[str, Any]:
        """``stream_options.include_usage``'s last chunk: no choices, the usage of all
        ``answers`` (the request's choices, ``n`` per prompt)."""
        return self._chunk([], usage=usage(answers, n).model_dump())
