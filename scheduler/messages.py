"""What crosses a scheduler's boundary: new requests, aborts, and both sides' answers.

Both the prefill scheduler and the decode peer take :class:`NewRequest` and :class:`AbortRequest`
on their thread-safe inboxes (a PD router sends the same request to both); the prefill scheduler
answers each request exactly once with a :class:`Response`, the decode peer with a
:class:`DecodeResponse`.
"""

from __future__ import annotations

import queue
from typing import Any, Protocol, TypeVar

import attrs

from kv.refusal import peer_refusal
from lifecycle import DecodeState, FailureReason, PrefillState, SamplingParams
from lifecycle.prefill import DEFAULT_SAMPLING, as_token_ids
from lifecycle.validators import of_type

# Requests for this bootstrap host use the fake transfer backend (SGLang's warm-up and
# health-check path).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
# The bootstrap host of the in-process local backend (prefill and decode in one process).
LOCAL_HOST = "local"


_STR, _INT = of_type(str, "a string"), of_type(int, "an integer")


@attrs.frozen
class NewRequest:
    """A request as a client submits it (to the prefill server and the decode peer alike).

    ``bootstrap_host`` names the peer and has no default: a request meant for the fake backend
    says so with :data:`FAKE_BOOTSTRAP_HOST`, so no request is ever routed to a peer nobody
    chose."""

    rid: str = attrs.field(validator=_STR)
    input_ids: tuple[int, ...] = attrs.field(converter=as_token_ids)
    bootstrap_host: str = attrs.field(validator=[_STR, attrs.validators.min_len(1)])
    bootstrap_port: int = attrs.field(default=0, validator=_INT)
    bootstrap_room: int = attrs.field(default=0, validator=_INT)
    sampling: SamplingParams = attrs.field(  # frozen: one shared default
        default=DEFAULT_SAMPLING, validator=of_type(SamplingParams, "a SamplingParams"))

    @bootstrap_room.validator
    def _check_room(self, _attr: object, value: int) -> None:
        # What a metadata row and the wire carry: an out-of-range room failed the engine's pass
        # when its first token was written.
        if not 0 <= value < 1 << 64:
            raise ValueError(f"request {self.rid!r}: bootstrap_room must be in 0 .. 2**64 - 1, "
                             f"got {value}")

    def record_fields(self) -> dict[str, Any]:
        """The fields a request record (prefill or decode) takes from the request."""
        return {
            "input_ids": self.input_ids,
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": self.bootstrap_room,
            "sampling": self.sampling,
        }


@attrs.frozen
class AbortRequest:
    """Abort the live request ``rid`` (ignored if it is unknown or finished): ``aborted`` by
    the client, or ``shutdown`` when its server closes under it. On a decode peer, ``peer``
    is set when the other half of the request failed (what it says,
    :func:`kv.refusal.peer_refusal`): this half then fails as if its prefill peer had refused
    it (a client's abort there stays an abort)."""

    rid: str
    shutdown: bool = False
    peer: str = ""

    def failure(self) -> tuple[FailureReason, str]:
        """The reason and detail the request fails with."""
        if self.shutdown:
            return FailureReason.SHUTDOWN, "the server is shutting down"
        return FailureReason.ABORTED, "aborted by the client"


@attrs.frozen
class FlushCache:
    """Empty the prefix cache (SGLang's ``/flush_cache``) on the pass this is received, when no
    request is live then; ``ticket`` says whose request it is (the rank that took it answers)."""

    ticket: int


@attrs.frozen
class CacheFlushed:
    """What a :class:`FlushCache` did: whether the cache was emptied (there is one and no
    request was live), the pages that went back to the pool, and the requests that stopped
    it: those live, and those ended whose KV transfer still reads the cached pages they lock."""

    flushed: bool
    pages: int
    live: int


#: What a prefill scheduler's inbox takes (and a mesh's first rank relays to the others).
InboxItem = NewRequest | AbortRequest | FlushCache


@attrs.frozen
class TokenLogprob:
    """A token's logprob and, when asked, the ``top`` alternatives at its position
    (``(token, logprob)`` pairs, most likely first) and the logprobs of the ids the request
    named (``asked``: ``(token, logprob)`` pairs in the request's ``token_ids_logprob`` order).
    ``logprob`` is None for the first prompt token, which nothing predicts (and ``asked`` is
    empty there)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    asked: tuple[tuple[int, float], ...] = ()


class _Answer:
    """What both sides' answers share: the HTTP status their outcome maps to."""

    __slots__ = ()
    reason: FailureReason | None

    @property
    def http_status(self) -> int:
        return 200 if self.reason is None else self.reason.http_status


@attrs.frozen
class Response(_Answer):
    """The one answer a request gets from the prefill side."""

    rid: str
    state: PrefillState
    reason: FailureReason | None
    detail: str
    first_token: int | None
    prompt_tokens: int
    # The request's lifecycle timeline, ``(monotonic time, event)`` pairs (lifecycle.timeline).
    timeline: tuple[tuple[float, str], ...] = ()
    # Prompt tokens found in the prefix cache, not computed (SGLang's ``cached_tokens``).
    cached_tokens: int = 0
    # With ``return_logprob``: the first output token's logprob, and the prompt tokens' from
    # ``logprob_start_len`` on.
    output_logprob: TokenLogprob | None = None
    input_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def ok(self) -> bool:
        return self.state is PrefillState.DONE

    def refusal(self) -> str:
        """What the decode half of this failed request is told
        (:attr:`AbortRequest.peer`): the reason, its status and the detail."""
        return peer_refusal(str(self.reason), self.http_status, self.detail)


@attrs.frozen
class DecodeResponse(_Answer):
    """The one answer a request gets from the decode side: the tokens it generated."""

    rid: str
    state: DecodeState
    reason: FailureReason | None
    detail: str
    output_ids: tuple[int, ...]
    finish_reason: str  # "length", "stop" or "abort"
    prompt_tokens: int
    timeline: tuple[tuple[float, str], ...] = ()
    # Prompt tokens the prefill side found in its prefix cache (its metadata row's count).
    cached_tokens: int = 0
    # With ``return_logprob``: one per output token (the first from the metadata row).
    output_logprobs: tuple[TokenLogprob, ...] = ()
    # What stopped a "stop" finish: a stop token id, a stop string, or None (EOS, or the
    # grammar completed).
    matched_stop: int | str | None = None

    @property
    def ok(self) -> bool:
        return self.state is DecodeState.DONE


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Takeable(Protocol[T_co]):
    """A thread-safe queue as :func:`take_all` reads it."""

    def get_nowait(self) -> T_co: ...


def take_all(q: Takeable[T]) -> list[T]:
    """Everything in ``q`` now, without blocking (inboxes and readiness queues)."""
    items: list[T] = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
