"""A live request as the HTTP side waits on it: the future its handler awaits and, for a
stream, the queue of what each engine pass added (new tokens, and their logprobs when asked).
The engine thread resolves and pushes; the handler's event loop receives, through
``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import attrs

from scheduler.messages import DecodeResponse, Response, TokenLogprob
from scheduler.service.config import Answer, Item

logger = logging.getLogger(__name__)


@attrs.frozen
class Progress:
    """What engine passes added to a streamed answer: new output tokens and, when the request
    asked for logprobs, one logprob per token (else none); the prompt tokens the prefix cache
    held (known with the first tokens)."""

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int = 0


@attrs.define(eq=False)
class Pending:
    """A live request as the HTTP side waits on it."""

    item: Item
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Answer]
    started: float
    waiting_on: set[str]
    progress: asyncio.Queue[Progress] | None = None
    prefill_failure: Response | None = None
    # Colocated (role both): the prefill side's input logprobs, for the decode side's answer.
    input_logprobs: tuple[TokenLogprob, ...] = ()
    # Colocated: the decode side's answer when it came before the prefill side's (engine thread).
    held: Answer | None = None
    streamed: int = 0  # output tokens handed to the stream (engine thread only)
    # A stream's chunk goes out once this many tokens are new (``--stream-interval``).
    interval: int = 1
    # The rids of the client's request that spawned this one (Service.abort_request).
    spawned_by: tuple[str, ...] = ()
    # With tracing on: the caller's trace headers, and the engines' answers (engine thread).
    carrier: dict[str, str] | None = None
    answers: list[Response | DecodeResponse] = attrs.field(factory=list)

    def resolve(self, answer: Answer) -> None:
        """Hand ``answer`` to the waiting handler (any thread; at most once takes effect)."""

        def settle() -> None:
            if not self.future.done():
                self.future.set_result(answer)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the handler's event loop is gone: nobody is waiting
            logger.debug("answer for %r dropped: its event loop is closed", self.item.rid)

    def due(self, produced: int) -> bool:
        """Whether ``produced`` output tokens make a chunk: the first at once (its time to
        first token is the pass's), then every :attr:`interval` new tokens, as SGLang's
        ``--stream-interval`` sends them; tokens held back go out with the next chunk, or with
        the answer."""
        new = produced - self.streamed
        return new > 0 and (self.streamed == 0 or new >= self.interval)

    def follow(self, output_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None,
               cached_tokens: int = 0) -> None:
        """Push the output tokens beyond those already streamed when they are :meth:`due`
        (engine thread), with the request's ``cached_tokens``. ``logprobs``: the request's
        output logprobs so far, or None when it did not ask for them; a token goes out with its
        logprob, so only tokens whose logprob is known are pushed; and none before the prefill
        side of a colocated request answered (its input logprobs are then known to every
        chunk)."""
        end = len(output_ids) if logprobs is None else min(len(output_ids), len(logprobs))
        if not self.due(end) or self.progress is None or "prefill" in self.waiting_on or (
                self.item.options.prompt_only):
            return
        start, self.streamed = self.streamed, end
        progress = Progress(tuple(output_ids[start:end]),
                            () if logprobs is None else tuple(logprobs[start:end]),
                            cached_tokens)
        try:
            self.loop.call_soon_threadsafe(self.progress.put_nowait, progress)
        except RuntimeError:
            logger.debug("stream tokens for %r dropped: its event loop is closed", self.item.rid)
