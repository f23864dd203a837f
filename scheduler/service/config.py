"""What a ``pdlife serve`` request is checked against, and the records it becomes.

:class:`ServeConfig` is everything a service is built from. :func:`check_item` turns one prompt
of a ``/generate`` call into an :class:`Item` or a :class:`BadRequest` that says what to change;
what it lets through can be computed (token ids in the vocabulary, the context and the pool big
enough), so the engines never meet input that would fail their loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import attrs

from kv.layouts import LayoutError, TPLayout
from kv.mooncake_engine import MooncakeConfig
from kv.pages import pages_needed
from kv.pool_layout import DEFAULT_KV_LAYOUT, KVLayout, parse_kv_layout
from lifecycle import FailureReason, SamplingParams
from lifecycle.validators import one_of, typed_fields
from scheduler.messages import FAKE_BOOTSTRAP_HOST, LOCAL_HOST, TokenLogprob
from scheduler.model.reference import ModelConfig
from scheduler.model.sharded import ShardError
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer_decision import DelayerConfig
from scheduler.runner import outside_vocabulary
from scheduler.service.logs import LogSettings
from scheduler.service.openai_tools import ToolAnswer
from scheduler.service.tool_formats import TOOL_CALL_PARSERS

Role = Literal["prefill", "decode", "both"]


def _addresses(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)
Backend = Literal["local", "mooncake", "fake"]
_MAX_ROOM = (1 << 64) - 1
MAX_RID_LEN = 256


@attrs.frozen(field_transformer=typed_fields)
class ServeConfig:
    """Everything a service is built from (validated when built)."""

    role: Role = attrs.field(validator=one_of(("prefill", "decode", "both")))
    backend: Backend = attrs.field(validator=one_of(("local", "mooncake", "fake")))
    model: ModelConfig = attrs.field(factory=ModelConfig)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    pool_pages: int = attrs.field(default=2048, validator=attrs.validators.gt(0))
    metadata_slots: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    waiting_timeout: float = attrs.field(default=300.0, validator=attrs.validators.gt(0))
    max_new_tokens_limit: int | None = None
    max_body_bytes: int = attrs.field(default=8 << 20, validator=attrs.validators.gt(0))
    # Requests holding no KV pages yet, beyond which new ones get 503 (scheduler.service.shedding);
    # None: no bound.
    max_queued_requests: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    # Clients must send ``Authorization: Bearer <api_key>`` (but to the health probes); None: open.
    api_key: str | None = attrs.field(default=None, repr=False)
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = attrs.field(
        default=8998, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    # Decode: the prefill bootstrap addresses (``HOST:PORT``) requests may name; empty: any. A
    # decode worker sends its peer token to the address a request names.
    allowed_prefills: tuple[str, ...] = attrs.field(default=(), converter=_addresses)

    @allowed_prefills.validator
    def _check_allowed_prefills(self, _attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        for address in value:
            host, _, port = str(address).rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"allowed_prefills: {address!r} is not a prefill's bootstrap "
                                 "address, HOST:PORT with PORT in 1..65535")
    mooncake: MooncakeConfig = attrs.field(factory=MooncakeConfig)
    #: The KV pool's layout; a decode server and its prefill servers must agree on it.
    kv_layout: KVLayout = attrs.field(default=DEFAULT_KV_LAYOUT, converter=parse_kv_layout)
    model_name: str = "pdlife-reference-llama"
    #: The format ``tool_choice`` auto reads the model's tool calls in (None: auto is refused).
    tool_call_parser: str | None = None
    device: str = "cpu"
    overlap: bool = False
    # Where finished requests' spans go over OTLP/HTTP (``HOST:PORT`` or a URL); None: no tracing.
    otlp_traces_endpoint: str | None = None
    # A loaded model (scheduler.model.select.ServedModel) to serve instead of the reference
    # model that ``model`` shapes: a real checkpoint, with its tokenizer and EOS ids.
    served: Any = attrs.field(default=None, eq=False, repr=False)
    # The parallel layout, ranks as processes: a prefill's TP x PP x DP
    # (scheduler.service.ranks), a decode's TP (scheduler.service.decode_ranks).
    tp_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    pp_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    dp_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # The PrefillDelayer negotiated across the DP replicas (scheduler.prefill.replica_delayer);
    # None: off (SGLang's default).
    prefill_delayer: DelayerConfig | None = None
    # How the worker's processes log (its rank processes take it from here).
    log: LogSettings = attrs.field(factory=LogSettings)
    # SGLang's --stream-interval: a stream's chunk goes out once this many tokens are new (the
    # first token at once, the last with the answer); 1: one per engine pass that added tokens.
    stream_interval: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # SGLang's --incremental-streaming-output: a /generate stream's chunk carries only what it
    # adds (text, output_ids, logprob entries), not the answer so far.
    incremental_streaming_output: bool = False

    def __attrs_post_init__(self) -> None:
        problem = self._parallel_problem()
        if problem:
            raise ValueError(problem)
        if (self.backend == "local") != (self.role == "both"):
            raise ValueError(
                f"ServeConfig.role {self.role!r} with backend {self.backend!r}: the local "
                "backend runs both roles in one process (role 'both'); prefill and decode "
                "roles need the mooncake or fake backend"
            )
        parser = self.tool_call_parser
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"ServeConfig.tool_call_parser {parser!r}: the formats read are "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        limit = self.max_new_tokens_limit
        if limit is not None and not 1 <= limit <= self.max_position:
            raise ValueError(
                f"ServeConfig.max_new_tokens_limit must be in 1..{self.max_position} "
                f"(the model's max_position), got {limit}"
            )

    def _parallel_problem(self) -> str:
        """Why the TP, PP and DP sizes cannot be served ("" when they can)."""
        tp, pp, dp = self.tp_size, self.pp_size, self.dp_size
        layout = f"TP {tp} x PP {pp} x DP {dp}"
        if self.prefill_delayer is not None and (self.role != "prefill" or dp == 1):
            return (f"{layout}, role {self.role!r}: the prefill delayer runs across the DP "
                    "replicas of a prefill server (--role prefill --dp-size N with N > 1; drop "
                    "--enable-prefill-delayer otherwise)")
        if tp * pp * dp == 1:
            return ""
        if self.role == "both":
            return (f"{layout}: only the prefill and decode roles run on several ranks; the "
                    "local backend's role 'both' is one rank (use --tp-size 1 --pp-size 1 "
                    "--dp-size 1)")
        if self.role == "decode" and (pp, dp) != (1, 1):
            return (f"{layout}: a decode server runs on several ranks only as TP (--tp-size "
                    "N); --pp-size and --dp-size are the prefill role's")
        if self.role == "decode" and self.backend != "mooncake":
            return (f"{layout} with backend {self.backend!r}: a decode server runs on several "
                    "ranks only over the mooncake backend (--backend mooncake)")
        if self.served is not None and not self.served.is_reference:
            from scheduler.model.sharded_checkpoint import check_tp

            if pp > 1:
                return (f"{layout}: a real checkpoint runs on TP ranks and DP replicas, not on "
                        "pipeline stages (use --pp-size 1; the reference model runs on PP)")
            try:
                check_tp(self.model_shape, tp)
            except (LayoutError, ShardError) as exc:
                return f"{layout}: {exc}"
            return ""
        from scheduler.model.sharded_checkpoint import tp_sizes

        m = self.model
        fits = (f" (--tp-size {', '.join(map(str, tp_sizes(m)))} fit the model; its --heads, "
                "--kv-heads and --intermediate decide)")
        for name, value in (("heads", m.heads), ("intermediate", m.intermediate)):
            if value % tp:
                return (f"{layout}: the model's {name} ({value}) must be a multiple of TP "
                        f"{tp}{fits}")
        try:
            TPLayout(tp, m.kv_heads)
        except LayoutError as exc:
            return f"{layout}: {exc}{fits}"
        if not 1 <= pp <= m.layers:
            return (f"{layout}: --pp-size must be in 1..{m.layers}, a stage for each of the "
                    f"model's --layers at most, got {pp}")
        return ""

    @property
    def max_position(self) -> int:
        """The served model's context, in positions."""
        return int(self.served.max_position if self.served else self.model.max_position)

    @property
    def max_request_tokens(self) -> int:
        """The most positions one request may use on this server (its prompt's, and all but
        its last answer token's): the model's context, and the KV pool (a prefill's pool holds
        the prompt, the others' the answer too). OpenAI's ``max_model_len`` for a client sizing
        its requests."""
        return min(self.max_position, self.pool_pages * self.scheduler.page_size)

    @property
    def model_shape(self) -> Any:
        """The whole served model's shape (``layers``, ``heads``, ``kv_heads``, ...), a rank's
        part or not: a real checkpoint's :class:`~scheduler.model.checkpoint.LlamaConfig` or
        ``model``."""
        if self.served is None:
            return self.model
        checkpoint = getattr(self.served.model, "checkpoint", None)  # None: the reference model
        return self.served.model.config if checkpoint is None else checkpoint.config

    @property
    def vocab_size(self) -> int:
        return int(self.served.vocab_size if self.served else self.model.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.served.eos_token_ids) if self.served else (self.model.eos_token_id,)

    @property
    def new_tokens_limit(self) -> int:
        return self.max_new_tokens_limit or self.max_position

    def may_contact(self, host: str, port: int) -> bool:
        """Whether this worker may send to the prefill bootstrap server at ``host:port``: a
        decode worker with ``allowed_prefills`` only to those (it sends its peer token)."""
        return (not self.allowed_prefills or self.role != "decode"
                or f"{host}:{port}" in self.allowed_prefills)

    @property
    def answered_by(self) -> Literal["prefill", "decode"]:
        return "prefill" if self.role == "prefill" else "decode"


class BadRequest(Exception):
    """The request can never be served as sent; ``reason`` is the error's type (code),
    ``label`` the metrics label (``reason`` unless said) and ``param`` the request field to
    change, when one is to blame (OpenAI's ``param``)."""

    def __init__(self, reason: str, message: str, *, rid: str | None = None,
                 status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.rid = rid
        self.status = status
        self.label = reason
        self.param = param


class ContextTooLong(BadRequest):
    """A prompt and its answer beyond what the server can hold (``prompt_too_long``): the
    model's context or (``pool``) the KV pool, ``limit`` tokens. The OpenAI routes say it as
    OpenAI does (``context_length_exceeded``), with the answer's length as their client asked
    it (a prefill's pool holds no answer, but the client still asked for one).
    ``prompt_fits``: the prompt alone would be served (with one answer token), so the answer's
    length is what to reduce."""

    def __init__(self, message: str, *, prompt_tokens: int, limit: int, prompt_fits: bool,
                 pool: bool = False) -> None:
        super().__init__("prompt_too_long", message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.prompt_fits = prompt_fits
        self.pool = pool


class Unavailable(Exception):
    """The service does not admit requests now (draining, or the engine loop failed)."""


@attrs.frozen
class AnswerOptions:
    """How a request wants its answer written (SGLang's fields; the engines never see them)."""

    no_stop_trim: bool = False  # keep a matched stop token's or string's text
    skip_special_tokens: bool = True
    return_text_in_logprobs: bool = False
    # ``/v1/completions``' ``echo``: the prompt's text, written before the answer's.
    echo: str | None = None
    # ``max_new_tokens`` 0: the prompt alone. The engines run a prefill's one token as for 1
    # (a disaggregated pair needs no other lifecycle); the answer drops it.
    prompt_only: bool = False
    # Chat's tool calls: how the answer is read for them (None: it is text).
    tools: ToolAnswer | None = None


@attrs.frozen
class Item:
    """One prompt of a ``/generate`` call, checked and ready to submit."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    options: AnswerOptions = AnswerOptions()

    @property
    def fake(self) -> bool:
        return self.bootstrap_host == FAKE_BOOTSTRAP_HOST

    @property
    def bootstrap_addr(self) -> str:
        return f"{self.bootstrap_host}:{self.bootstrap_port}"


@attrs.frozen
class Answer:
    """What a request ended with, in the terms of SGLang's ``/generate`` answer."""

    rid: str
    status: int
    output_ids: tuple[int, ...]
    finish_reason: str  # "length", "stop" or "abort"
    message: str
    reason: FailureReason | None
    prompt_tokens: int
    e2e_latency: float
    cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache
    # With ``return_logprob``: the prompt's (prefill side) and the output tokens'.
    input_logprobs: tuple[TokenLogprob, ...] = ()
    output_logprobs: tuple[TokenLogprob, ...] = ()
    matched_stop: int | str | None = None  # the stop token or string that ended the answer
    # The error type when it is not ``reason``'s: a peer's refusal the client can act on.
    kind: str | None = None


def check_item(
    config: ServeConfig,
    rooms: Iterator[int],
    *,
    rid: str,
    input_ids: Sequence[int],
    sampling: SamplingParams,
    bootstrap_host: str | None,
    bootstrap_port: int | None,
    bootstrap_room: int | None,
) -> Item:
    """One prompt as an :class:`Item`, or :class:`BadRequest` (carrying ``rid``) saying what is
    wrong (``sampling`` comes from :func:`.sampling.sampling_params_from`, which checks the
    fields on their own; this checks them against the server). Fake-host requests (and every
    request of the fake and local backends) take their room from ``rooms``: no prefill server
    pairs with them."""
    if len(rid) > MAX_RID_LEN:  # not echoed: it may be megabytes
        raise BadRequest("bad_rid", f"rid must be 1..{MAX_RID_LEN} characters, got {len(rid)}")
    try:
        if not rid:
            raise BadRequest("bad_rid", f"rid must be 1..{MAX_RID_LEN} characters, got ''")
        _check_prompt(config, rid, input_ids)
        _check_named_ids(config, rid, sampling)
        _check_lengths(config, rid, len(input_ids), sampling.max_new_tokens)
        return _with_bootstrap(config, rooms, rid, tuple(input_ids), sampling,
                               bootstrap_host, bootstrap_port, bootstrap_room)
    except BadRequest as exc:
        exc.rid = rid
        raise


def _check_prompt(config: ServeConfig, rid: str, input_ids: Sequence[int]) -> None:
    vocab = config.vocab_size
    if not input_ids:
        raise BadRequest("empty_prompt", f"request {rid!r}: the prompt is empty")
    problem = outside_vocabulary(input_ids, vocab)
    if problem:
        raise BadRequest("bad_token_id", f"request {rid!r}: {problem}")


def _check_named_ids(config: ServeConfig, rid: str, sampling: SamplingParams) -> None:
    """The token ids a request names beside its prompt are in the vocabulary."""
    vocab = config.vocab_size
    for field, ids in (("sampling_params.logit_bias", [t for t, _ in sampling.logit_bias]),
                       ("sampling_params.stop_token_ids", sorted(sampling.stop_token_ids)),
                       ("token_ids_logprob", sampling.token_ids_logprob)):
        problem = outside_vocabulary(ids, vocab)
        if problem:
            raise BadRequest("bad_token_id", f"request {rid!r}: {field}: {problem}")


def _check_lengths(config: ServeConfig, rid: str, n: int, max_new_tokens: int) -> None:
    """The answer's length limit, the model's context and the KV pool."""
    c = config
    limit = c.new_tokens_limit
    if not 1 <= max_new_tokens <= limit:
        raise BadRequest(
            "bad_max_new_tokens",
            f"request {rid!r}: sampling_params.max_new_tokens must be in 1..{limit}, "
            f"got {max_new_tokens}",
        )
    # With one answer token, the prompt alone: the context and the pool, whatever the role.
    prompt_fits = n <= c.max_request_tokens
    # The last output token is never fed back: it needs no position.
    beyond_context = n + max_new_tokens - 1 > c.max_position
    # A prefill's pool holds the prompt; the others' the answer too, but for its last token.
    new_tokens = max_new_tokens if c.role != "prefill" else 0
    kv_tokens = max(n + new_tokens - 1, n)
    pool_tokens = c.pool_pages * c.scheduler.page_size
    beyond_pool = pages_needed(kv_tokens, c.scheduler.page_size) > c.pool_pages
    # Beyond both, the smaller limit is the one to name: what this server can take.
    if beyond_context and not (beyond_pool and pool_tokens < c.max_position):
        raise ContextTooLong(
            f"request {rid!r}: prompt ({n} tokens) + max_new_tokens ({max_new_tokens}) - 1 "
            f"exceeds the model's context of {c.max_position} positions",
            prompt_tokens=n, limit=c.max_position, prompt_fits=prompt_fits)
    if beyond_pool:
        need = (f"the prompt ({n} tokens) and max_new_tokens ({new_tokens}), less the last "
                f"token, need {kv_tokens}" if new_tokens else f"the prompt needs {n}")
        raise ContextTooLong(
            f"request {rid!r}: {need} tokens of KV, more than the KV pool's {pool_tokens}",
            prompt_tokens=n, limit=pool_tokens, prompt_fits=prompt_fits, pool=True)


def _with_bootstrap(
    config: ServeConfig,
    rooms: Iterator[int],
    rid: str,
    input_ids: tuple[int, ...],
    sampling: SamplingParams,
    host: str | None,
    port: int | None,
    room: int | None,
) -> Item:
    """The item with its peer: the router's bootstrap fields, or a room of the service's own
    for requests no prefill server pairs with (fake host, fake and local backends)."""
    c = config
    if room is not None and not 0 <= room <= _MAX_ROOM:
        raise BadRequest("bad_bootstrap", f"request {rid!r}: bootstrap_room must be a uint64")
    fake = host == FAKE_BOOTSTRAP_HOST or c.backend == "fake"
    if fake or c.backend == "local":
        own_host = FAKE_BOOTSTRAP_HOST if fake else LOCAL_HOST
        return Item(rid, input_ids, sampling, own_host, 0, next(rooms))
    if host is None or port is None or room is None:
        raise BadRequest(
            "missing_bootstrap",
            f"request {rid!r}: the {c.role} role needs bootstrap_host, bootstrap_port and "
            f"bootstrap_room (a PD router adds them; bootstrap_host {FAKE_BOOTSTRAP_HOST} "
            "runs the request without a peer)",
        )
    if not 1 <= port <= 65535:
        raise BadRequest("bad_bootstrap", f"request {rid!r}: bootstrap_port must be 1..65535")
    if not c.may_contact(host, port):
        raise BadRequest("bad_bootstrap", f"request {rid!r}: {host}:{port} is not a prefill "
                         "server this worker may contact (--allow-prefill)")
    return Item(rid, input_ids, sampling, host, port, room)
