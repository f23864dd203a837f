"""The prefill lifecycle: its states, its table, and the prefill request record.

Theory of operation
-------------------
A request arrives with its prompt and the bootstrap address and room the router gave it. It is
admitted in BOOTSTRAPPING with a KV sender; when the decode peer's destination for its room has
arrived and a metadata slot was allocated it is ``bootstrapped`` into WAITING. The PrefillAdder
``schedule``s it into FORWARD (pages allocated for its first chunk); each non-last chunk ends in
``chunk_done`` (FORWARD → FORWARD, full pages sent), the last in ``prefilled`` (first token
sampled, last pages and the metadata row sent) into TRANSFERRING; the sender's success is
``transferred`` into DONE. ``fail`` and ``abort`` are legal from every live state and lead to
FAILED. Entering DONE or FAILED runs the ``release`` and ``respond`` hooks, exactly once.
A failed request's reason is a :class:`~lifecycle.reasons.FailureReason`, which carries the
HTTP status its client gets.

The state values are ordered so that a MIN across ranks yields the most pessimistic state, as
the KV transfer poll results are.
"""

from __future__ import annotations

import enum
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import regex

from lifecycle.reasons import FailureReason
from lifecycle.record import Owner, Tracked
from lifecycle.request_table import request_table
from lifecycle.table import Edge
from lifecycle.validators import of_type


class PrefillState(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING = 2
    FORWARD = 3
    TRANSFERRING = 4
    DONE = 5


class PrefillEvent(enum.StrEnum):
    """The events of :data:`PREFILL_TABLE`."""

    BOOTSTRAPPED = "bootstrapped"
    SCHEDULE = "schedule"
    CHUNK_DONE = "chunk_done"
    PREFILLED = "prefilled"
    TRANSFERRED = "transferred"
    FAIL = "fail"
    ABORT = "abort"


def as_token_ids(ids: Iterable[int]) -> tuple[int, ...]:
    """Token ids as the immutable tuple of ints records keep (an attrs converter); numpy's and
    torch's integer scalars become ints. Anything but an iterable of integers (a string, one
    int, floats) raises ``TypeError``."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise TypeError(f"token ids must be a sequence of integers, got {ids!r:.80}")
    given = ids if isinstance(ids, Sequence) else tuple(ids)  # read twice on a refusal
    try:
        return tuple(map(operator.index, given))
    except TypeError:
        bad = next(t for t in given if not hasattr(t, "__index__"))
        raise TypeError(f"token ids must be integers, got {bad!r:.40} "
                        f"({type(bad).__name__})") from None


def as_stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """Stop strings as the tuple records keep (an attrs converter): one string is one stop
    string, not its characters; None is none; anything else raises ``ValueError``."""
    if stop is None:
        return ()
    if not isinstance(stop, str | Iterable):
        raise ValueError(f"stop must be a string or strings, got {stop!r}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or strings, got {stop!r}")
    return stops


def as_logit_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]]
                  ) -> tuple[tuple[int, float], ...]:
    """A logit bias as the sorted ``(token id, bias)`` pairs records keep (an attrs converter);
    raises ``ValueError`` for a negative id, an id given twice or a bias that is not finite."""
    pairs = sorted((int(t), float(b)) for t, b in (
        bias.items() if isinstance(bias, Mapping) else bias))
    if len({token for token, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias: a token id is given twice")
    for token, value in pairs:
        if token < 0:
            raise ValueError(f"logit_bias: token ids must be >= 0, got {token}")
        if not math.isfinite(value):
            raise ValueError(f"logit_bias: the bias of token {token} must be finite, got {value}")
    return tuple(pairs)


#: A temperature below this is greedy: dividing logits by it would overflow them.
GREEDY_BELOW = 1e-6
#: The most top logprobs a request may ask for per position (OpenAI's limit, the metadata row's).
TOP_LOGPROBS_MAX = 20
#: The most token ids whose logprobs a request may ask for at every position
#: (``token_ids_logprob``): a metadata row carries the first output token's.
TOKEN_IDS_LOGPROB_MAX = 64


class GrammarKind(enum.StrEnum):
    """How a structured-output constraint is written."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's ``response_format`` json_object)
    REGEX = "regex"
    EBNF = "ebnf"  # a Lark grammar


@attrs.frozen
class GrammarSpec:
    """A structured-output constraint: its kind and its source text (a JSON schema as JSON)."""

    kind: GrammarKind = attrs.field(converter=GrammarKind)
    source: str = ""


_INT = of_type(int, "an integer")
_NUMBER = of_type((float, int), "a number")
_BOOL = of_type(bool, "a bool")


def _in(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: ``value`` in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``)."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
        ok = (lo < value if lo_open else lo <= value) and value <= hi
        if not ok:
            bounds = f"{'(' if lo_open else '['}{lo}, {hi}]"
            raise ValueError(f"{attribute.name} must be in {bounds}, got {value}")

    return check


@attrs.frozen
class SamplingParams:
    """What the client asked of the generation (validated at the boundary).

    ``temperature`` 0 is greedy (ties go to the lowest token id), and so is one below
    :data:`GREEDY_BELOW` (as in SGLang); above that the next token is drawn
    from the softmax of ``logits / temperature`` restricted by ``top_k`` (0 = no limit),
    ``top_p`` and ``min_p``, with the uniform number of output position ``i`` taken from the
    request's ``seed`` (``scheduler.sample`` defines the stream, so the prefill side can draw
    position 0 and the decode side the rest). ``stop`` strings, and matches of the ``stop_regex``
    patterns (Python ``re``'s syntax), are searched for in the decoded text.
    ``return_logprob`` asks for each output token's logprob (and ``top_logprobs_num``
    alternatives, and the logprobs of the ``token_ids_logprob`` ids, in their order); input
    logprobs start at ``logprob_start_len`` (-1: none).

    Before that the logits are adjusted (SGLang's and OpenAI's rules, over the output tokens
    only): ``frequency_penalty`` times a token's count so far and ``presence_penalty`` once it
    occurred are subtracted, ``repetition_penalty`` divides an occurred token's positive logit
    and multiplies a negative one, the model's end-of-sequence ids and ``stop_token_ids`` are
    excluded until the answer has ``min_new_tokens`` tokens, and ``logit_bias`` (token id →
    bias) is added.
    """

    max_new_tokens: int = attrs.field(default=16, validator=_INT)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=as_token_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_BOOL)
    temperature: float = attrs.field(default=0.0, kw_only=True,
                                     validator=[_NUMBER, _in(0.0, 100.0)])
    top_p: float = attrs.field(default=1.0, kw_only=True,
                               validator=[_NUMBER, _in(0.0, 1.0, lo_open=True)])
    top_k: int = attrs.field(default=0, kw_only=True, validator=[_INT, _in(0, 1 << 31)])
    min_p: float = attrs.field(default=0.0, kw_only=True, validator=[_NUMBER, _in(0.0, 1.0)])
    seed: int | None = attrs.field(default=None, kw_only=True,
                                   validator=attrs.validators.optional(_INT))
    stop: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=as_stop_strings)
    stop_regex: tuple[str, ...] = attrs.field(default=(), kw_only=True,
                                              converter=as_stop_strings)
    return_logprob: bool = attrs.field(default=False, kw_only=True, validator=_BOOL)
    top_logprobs_num: int = attrs.field(default=0, kw_only=True,
                                        validator=[_INT, _in(0, TOP_LOGPROBS_MAX)])
    logprob_start_len: int = attrs.field(default=-1, kw_only=True, validator=_INT)
    grammar: GrammarSpec | None = attrs.field(default=None, kw_only=True, validator=(
        attrs.validators.optional(of_type(GrammarSpec, "a GrammarSpec"))))
    frequency_penalty: float = attrs.field(default=0.0, kw_only=True,
                                           validator=[_NUMBER, _in(-2.0, 2.0)])
    presence_penalty: float = attrs.field(default=0.0, kw_only=True,
                                          validator=[_NUMBER, _in(-2.0, 2.0)])
    repetition_penalty: float = attrs.field(default=1.0, kw_only=True,
                                            validator=[_NUMBER, _in(0.0, 2.0, lo_open=True)])
    min_new_tokens: int = attrs.field(default=0, kw_only=True, validator=_INT)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), kw_only=True,
                                                            converter=as_logit_bias)
    token_ids_logprob: tuple[int, ...] = attrs.field(default=(), kw_only=True,
                                                     converter=as_token_ids)

    @stop_token_ids.validator
    def _check_stop_ids(self, _attr: object, value: tuple[int, ...]) -> None:
        if value and min(value) < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {min(value)}")

    @stop.validator
    def _check_stop(self, _attr: object, value: tuple[str, ...]) -> None:
        if "" in value:
            raise ValueError("a stop string must not be empty (it would match at once)")

    @stop_regex.validator
    def _check_stop_regex(self, _attr: object, value: tuple[str, ...]) -> None:
        for pattern in value:
            # The engines (scheduler.sample.stops) read a pattern's width with re's parser and
            # search with the regex module (VERSION0: re's syntax and meaning): both must take
            # it (re refuses a variable-width look-behind, regex a POSIX class it does not know).
            try:
                compiled = re.compile(pattern)
                regex.compile(pattern, regex.VERSION0)
            except (re.error, regex.error) as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a regular expression: "
                                 f"{exc}") from None
            if compiled.search("") is not None:
                raise ValueError(f"stop_regex {pattern!r} matches the empty string (it would "
                                 "match at once)")

    @max_new_tokens.validator
    def _check_max_new(self, _attr: object, value: int) -> None:
        if not 1 <= value <= 1 << 20:
            raise ValueError(f"max_new_tokens must be in 1..{1 << 20}, got {value}")

    @seed.validator
    def _check_seed(self, _attr: object, value: int | None) -> None:
        if value is not None and not 0 <= value < 1 << 64:
            raise ValueError(f"seed must be in 0 .. 2**64 - 1, got {value}")

    @logprob_start_len.validator
    def _check_start(self, _attr: object, value: int) -> None:
        if value < -1:
            raise ValueError(
                f"logprob_start_len must be -1 (no input logprobs) or >= 0, got {value}"
            )

    @token_ids_logprob.validator
    def _check_token_ids(self, _attr: object, value: tuple[int, ...]) -> None:
        if not value:
            return
        if not self.return_logprob:
            raise ValueError("token_ids_logprob needs return_logprob")
        if len(value) > TOKEN_IDS_LOGPROB_MAX or min(value) < 0:
            raise ValueError(f"token_ids_logprob must hold 1..{TOKEN_IDS_LOGPROB_MAX} token ids "
                             f">= 0, got {len(value)} (smallest {min(value)})")

    @min_new_tokens.validator
    def _check_min_new(self, _attr: object, value: int) -> None:
        if not 0 <= value <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in 0..max_new_tokens "
                             f"({self.max_new_tokens}), got {value}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty looks at the output so far (frequency, presence, repetition)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before sampling (a penalty, ``min_new_tokens``, a bias)."""
        return self.penalized or self.min_new_tokens > 0 or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (a temperature below :data:`GREEDY_BELOW`,
        0 included, or a top-k of 1)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def plain(self) -> bool:
        """Greedy with nothing else asked: a runner's ``forward`` answers it alone."""
        return (self.greedy and not self.return_logprob and self.grammar is None
                and not self.adjusts_logits)


#: What a request that asks for nothing gets: one shared instance (it is frozen), because
#: building and validating a SamplingParams costs more than the rest of a record.
DEFAULT_SAMPLING = SamplingParams()


@attrs.define(slots=True, eq=False, weakref_slot=False)
class PrefillRequest(Tracked):
    """A request on the prefill server.

    Progress: ``scheduled`` tokens were handed to a forward; ``computed`` tokens have their K/V
    in the pool; ``sent`` tokens have been handed to the sender. (Under the overlap loop the
    next chunk is scheduled before the previous one's result is processed, so ``scheduled``
    may run ahead of ``computed``.) Resources (see the ownership table in docs/lifecycle.md):
    ``sender`` from BOOTSTRAPPING, ``slot`` from WAITING, ``pages`` (and with state pools
    their SWA pages and ``state_slot``) from FORWARD; the
    ``release`` hook gives all of them up on entering a final state (the KV layer frees pages and
    slot once no transfer can touch them any more). The trigger methods (``req.schedule()``,
    ``req.fail(detail, reason=...)``, ...) come from :data:`PREFILL_TABLE`.

    Give the fields after ``rid`` by keyword. They are not declared keyword-only because
    CPython fills a missing keyword-only argument's default with a dict lookup and a positional
    one's from a tuple: for a record built with most fields at their defaults, as most are,
    that was a fifth of its construction (docs/benchmarks.md, the lifecycle section). For the
    same reason :class:`Tracked`'s fields, keyword-only there so that a second positional
    argument can only be the prompt, are declared again last, after every field of the request
    (about 600 instructions less per record).
    """

    input_ids: Sequence[int] = attrs.field(default=(), repr=False)
    bootstrap_host: str = attrs.field(default="")
    bootstrap_port: int = attrs.field(default=0)
    bootstrap_room: int = attrs.field(default=0)
    sampling: SamplingParams = attrs.field(default=DEFAULT_SAMPLING, repr=False)
    scheduled: int = attrs.field(default=0)
    computed: int = attrs.field(default=0)
    sent: int = attrs.field(default=0)
    pages: list[int] = attrs.field(factory=list, repr=False)
    slot: int | None = attrs.field(default=None)
    sender: object | None = attrs.field(default=None, repr=False)
    deadline: float | None = attrs.field(default=None)
    first_token: int | None = attrs.field(default=None)
    # A failure (an abort, or the peer's) that arrived while batches holding the request were
    # on the device (``on_device`` counts them): it takes effect once the last of those
    # results has been processed, so pages are never freed under a running forward.
    pending_abort: FailureReason | None = attrs.field(default=None)
    on_device: int = attrs.field(default=0)
    # The prefix cache: ``cached`` prompt tokens were found computed in the cache when the
    # request was scheduled (their pages are the cache's, not computed again); ``prefix`` is
    # the request's hold on the cache (a ``kv.radix.PrefixHold``; None with the cache off),
    # given up with its pages.
    cached: int = attrs.field(default=0)
    prefix: object | None = attrs.field(default=None, repr=False)
    # The request's recurrent-state slot (``kv.state_pools``), taken with its first pages when
    # the model has recurrent layers and given up with its pages.
    state_slot: int | None = attrs.field(default=None)
    # Tracked's own fields, declared again to come last and not keyword-only (see above), the
    # failure reason narrowed to the table's.
    state: enum.IntEnum | None = attrs.field(default=None)
    reason: FailureReason | None = attrs.field(default=None)
    detail: str = attrs.field(default="")
    timeline: list[tuple[float, str]] = attrs.field(factory=list, repr=False)
    owner: Owner | None = attrs.field(default=None, repr=False)

    def fully_computed(self) -> bool:
        return self.computed >= len(self.input_ids)


_S = PrefillState
_E = PrefillEvent

PREFILL_TABLE = request_table(
    "prefill",
    PrefillState,
    PrefillEvent,
    path=(
        Edge(
            _E.BOOTSTRAPPED,
            _S.BOOTSTRAPPING,
            _S.WAITING,
            doc="the decode peer's destination arrived and a metadata slot was allocated",
        ),
        Edge(
            _E.SCHEDULE,
            _S.WAITING,
            _S.FORWARD,
            doc="the PrefillAdder admitted the request (whole, or its first chunk)",
        ),
        Edge(
            _E.CHUNK_DONE,
            _S.FORWARD,
            _S.FORWARD,
            unless="fully_computed",
            doc="a non-last chunk was computed; its full pages were sent",
        ),
        Edge(
            _E.PREFILLED,
            _S.FORWARD,
            _S.TRANSFERRING,
            conditions="fully_computed",
            doc="the last chunk was computed and the first token sampled; the rest was sent",
        ),
        Edge(
            _E.TRANSFERRED,
            _S.TRANSFERRING,
            _S.DONE,
            doc="the sender reports success",
        ),
    ),
    fail_doc="rejected, bootstrap or transfer failure, timeout, internal error",
    record=PrefillRequest,
)
