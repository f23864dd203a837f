"""A live request as the HTTP side waits on it: the future its handler awaits and, for a
stream, the queue of new tokens. The engine thread resolves and pushes; the handler's event loop
receives, through ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import logging

import attrs

from scheduler.messages import DecodeResponse, Response, TokenLogprob
from scheduler.service.config import Answer, Item

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class Pending:
    """A live request as the HTTP side waits on it."""

    item: Item
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Answer]
    started: float
    waiting_on: set[str]
    progress: asyncio.Queue[tuple[int, ...]] | None = None
    prefill_failure: Response | None = None
    # Colocated (role both): the prefill side's input logprobs, for the decode side's answer.
    input_logprobs: tuple[TokenLogprob, ...] = ()
    streamed: int = 0  # output tokens handed to the stream (engine thread only)
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

    def push(self, tokens: tuple[int, ...]) -> None:
        if self.progress is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.progress.put_nowait, tokens)
        except RuntimeError:
            logger.debug("stream tokens for %r dropped: its event loop is closed", self.item.rid)
