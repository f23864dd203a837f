"""The bodies of ``/generate`` answers, in SGLang's shapes: the text (trimmed before a matched
stop), ``finish_reason``, and the logprob fields of ``meta_info``.

Logprobs follow SGLang's ``meta_info``: ``input_token_logprobs`` and ``output_token_logprobs``
are lists of ``[logprob, token_id, text]`` triples (``text`` null unless
``return_text_in_logprobs``; the first prompt token's logprob is null, nothing predicts it);
``input_top_logprobs`` and ``output_top_logprobs``, present only when ``top_logprobs_num`` > 0,
hold one list of such triples per position (null where a position has none), and so do
``input_token_ids_logprobs`` and ``output_token_ids_logprobs``, present only with
``token_ids_logprob``: the named ids' triples in their order (a logprob that is not a number,
an id a grammar forbids there, is null). Which side fills
which field is the role's: a prefill worker answers its input logprobs and the first output
token's, a decode worker the output tokens' with an empty ``input_token_logprobs`` (SGLang's
router prepends the prefill's there), a colocated worker all of them.

A stream's text is :class:`IncrementalText`: the answer's text so far (:func:`continuation`'s),
kept as the output grows, so a pass decodes only the tokens after a settled run.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from scheduler.messages import TokenLogprob
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.sample.stops import CONTEXT_TOKENS, Stops, decoded_after
from scheduler.service.config import Answer, Item
from scheduler.service.schema import FinishReason, GenerateAnswer, MetaInfo

#: The ``meta_info`` keys that only logprob answers carry.
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")


def decode(tokenizer: Any, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """The text of ``ids``. The byte tokenizer's special tokens have no text either way."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    text: str = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return text


def continuation(tokenizer: Any, item: Item, ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``item``'s prompt: decoded after the prompt's last
    :data:`~scheduler.sample.stops.CONTEXT_TOKENS` tokens, and cut after their text (or alone,
    where the two do not join at a character boundary)."""
    skip = item.options.skip_special_tokens
    context = [] if isinstance(tokenizer, ByteTokenizer) else item.input_ids[-CONTEXT_TOKENS:]
    return decoded_after(lambda t: decode(tokenizer, t, skip_special_tokens=skip), context, ids)


class IncrementalText:
    """The text a streamed answer's output tokens add after its prompt (:func:`continuation`'s,
    byte for byte), kept as the output grows: the text of a settled run of leading tokens, and
    only the tokens after it decoded again each time, after the last few settled ones. A run is
    settled where its text ends a character (a trailing run of byte-fallback tokens is one
    character group still open: a later byte can turn the group's text into replacement
    characters; a skipped special token, which has no text, does not close it) and the tokens
    before the rest decode to text that does not end inside one, so the rest's text is
    :func:`~scheduler.sample.stops.decoded_after` them as in the whole.

    A settled run's text begins the text of every output that begins with the run, a shorter
    one as well as a longer, so each run settled so far is kept: the text of any prefix of the
    output (:meth:`upto`) is decoded after the longest run within it, as the whole is after the
    last (a stream holds back its last tokens, which the last run may already cover)."""

    def __init__(self, tokenizer: Any, item: Item) -> None:
        skip = item.options.skip_special_tokens
        self._decode: Callable[[Sequence[int]], str] = lambda ids: decode(
            tokenizer, ids, skip_special_tokens=skip)
        self._bytes = isinstance(tokenizer, ByteTokenizer)  # its text joins with no context
        self._prompt = list(item.input_ids[-CONTEXT_TOKENS:])
        self._open: frozenset[int] = getattr(tokenizer, "byte_pieces", frozenset())
        self.ids: list[int] = []
        self._settled = ""  # the text of ids[:_done]
        self._done = 0
        # The runs settled so far, shortest first (the empty one too): their lengths in tokens,
        # and in characters of _settled.
        self._runs = [0]
        self._chars = [0]

    def _context(self, end: int) -> list[int]:
        """The tokens the output's text from ``end`` on is decoded after (as :func:`continuation`
        and :meth:`~scheduler.sample.stops.Stops.tail_text` take them)."""
        if self._bytes:
            return []
        before = self.ids[max(end - CONTEXT_TOKENS, 0):end]
        if len(before) < CONTEXT_TOKENS:
            before[:0] = self._prompt[-(CONTEXT_TOKENS - len(before)):]
        return before

    def _joins(self, end: int) -> bool:
        """Whether the output's text from ``end`` on can be decoded after the tokens before it:
        theirs is text (a SentencePiece decoder strips the space a text starts with, so text
        decoded after none would lose it) that ends a character."""
        if self._bytes:
            return True
        before = self._decode(self._context(end))
        return bool(before) and not before.endswith("\ufffd")

    def more(self, tokens: Sequence[int]) -> str:
        """The text of the output so far, ``tokens`` added."""
        self.ids.extend(tokens)
        context = self._context(self._done)
        rest = decoded_after(self._decode, context, self.ids[self._done:])
        text = self._settled + rest
        end = len(self.ids)
        while end > self._done and self._open and (
                self.ids[end - 1] in self._open or not self._decode(self.ids[end - 1:end])):
            end -= 1
        if end > self._done:
            part = rest if end == len(self.ids) else decoded_after(
                self._decode, context, self.ids[self._done:end])
            if part and not part.endswith("\ufffd") and self._joins(end):
                self._settled, self._done = self._settled + part, end
                self._runs.append(end)
                self._chars.append(len(self._settled))
        return text

    def upto(self, end: int) -> str:
        """The text of the output's first ``end`` tokens (``continuation(ids[:end])``)."""
        at = bisect.bisect_right(self._runs, end) - 1
        start = self._runs[at]
        return self._settled[:self._chars[at]] + decoded_after(
            self._decode, self._context(start), self.ids[start:end])


def answer_text(tokenizer: Any, item: Item, ids: Sequence[int],
                matched: int | str | None) -> str:
    """The answer's text as SGLang gives it (:func:`continuation`): a matched stop token's text,
    or the text from where the first stop string or regex match begins, is cut off unless
    ``no_stop_trim``."""
    trim = matched is not None and not item.options.no_stop_trim
    if trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = continuation(tokenizer, item, ids)
    if trim and isinstance(matched, str):
        text = text[:Stops.of(item.sampling).cut(text)]
    return text


def final_text(tokenizer: Any, item: Item, answer: Answer) -> str:
    """The text of a finished answer: trimmed of the stop token or string that ended it (not of
    the last token of a completed grammar, which matched no stop)."""
    matched = answer.matched_stop if answer.finish_reason == "stop" else None
    return answer_text(tokenizer, item, answer.output_ids, matched)


def finish_reason(answer: Answer) -> FinishReason:
    ids = answer.output_ids
    if answer.finish_reason == "abort":
        return FinishReason(type="abort", message=answer.message or "aborted",
                            status_code=answer.status)
    if answer.finish_reason == "length":
        return FinishReason(type="length", length=len(ids))
    # A stop token, a stop string, else what ended the answer: EOS, or a completed grammar.
    matched = answer.matched_stop
    return FinishReason(type="stop", matched=matched if matched is not None else (
        ids[-1] if ids else None))


def _triples(tokenizer: Any, pairs: Iterable[tuple[float | None, int]],
             with_text: bool) -> list[list[Any]]:
    # JSON has no infinity: a token the request's adjustments ruled out has no logprob (None).
    return [[lp if lp is not None and math.isfinite(lp) else None, tok,
             decode(tokenizer, [tok], skip_special_tokens=False) if with_text else None]
            for lp, tok in pairs]


def logprob_fields(tokenizer: Any, item: Item, inputs: Sequence[TokenLogprob],
                   outputs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The logprob keys of ``meta_info`` (none unless the request asked for logprobs)."""
    sampling, text = item.sampling, item.options.return_text_in_logprobs
    if not sampling.return_logprob:
        return {}
    fields: dict[str, Any] = {
        "input_token_logprobs": _triples(tokenizer, ((t.logprob, t.token) for t in inputs), text),
        "output_token_logprobs": _triples(tokenizer, ((t.logprob, t.token) for t in outputs),
                                          text),
    }
    if sampling.top_logprobs_num > 0:
        for key, entries in (("input_top_logprobs", inputs), ("output_top_logprobs", outputs)):
            fields[key] = [_triples(tokenizer, ((lp, tok) for tok, lp in t.top), text)
                           if t.top else None for t in entries]
    if sampling.token_ids_logprob:
        for key, entries in (("input_token_ids_logprobs", inputs),
                             ("output_token_ids_logprobs", outputs)):
            fields[key] = [_triples(tokenizer, ((lp, tok) for tok, lp in t.asked), text)
                           if t.asked else None for t in entries]
    return fields


def answer_body(tokenizer: Any, item: Item, *, ids: Sequence[int], text: str,
                prompt_tokens: int, latency: float, finish: FinishReason | None,
                cached_tokens: int = 0, input_logprobs: Sequence[TokenLogprob] = (),
                output_logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """One answer (or stream chunk: ``finish`` None) for ``item``, ``ids`` generated so far,
    with its logprob fields when asked for (a chunk's: those of the answer so far)."""
    body = GenerateAnswer(
        text=text,
        output_ids=list(ids),
        meta_info=MetaInfo(
            id=item.rid, finish_reason=finish, prompt_tokens=prompt_tokens,
            completion_tokens=len(ids), e2e_latency=latency, cached_tokens=cached_tokens,
        ),
    ).model_dump(exclude={"meta_info": set(LOGPROB_KEYS)})
    if finish is not None:  # SGLang's finish_reason carries only the keys of its type
        body["meta_info"]["finish_reason"] = finish.model_dump(exclude_none=True)
    body["meta_info"].update(logprob_fields(tokenizer, item, input_logprobs, output_logprobs))
    return body


def final_body(tokenizer: Any, item: Item, answer: Answer) -> dict[str, Any]:
    """The answer of a request that ended well."""
    return answer_body(tokenizer, item, ids=answer.output_ids,
                       text=final_text(tokenizer, item, answer),
                       prompt_tokens=answer.prompt_tokens, latency=answer.e2e_latency,
                       finish=finish_reason(answer), cached_tokens=answer.cached_tokens,
                       input_logprobs=answer.input_logprobs,
                       output_logprobs=answer.output_logprobs)
