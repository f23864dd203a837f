"""From a client's sampling fields to the :class:`~lifecycle.SamplingParams` a request carries.

One place decides what pdlife honours. Every field of SGLang's ``sampling_params`` is either
mapped (temperature, top-k/p, min-p, the seed, stops, a grammar, the logprob options, the
penalties, ``min_new_tokens``, ``logit_bias``) or refused
with a 400 that names it when its value is not the neutral one: a client that asks for a
repetition penalty must not get an answer without one, untold. Fields SGLang does not have are
ignored (the router adds several). Both HTTP APIs come here: ``/generate`` with its own body, the
OpenAI endpoints after translating their names into a :class:`SamplingParamsBody`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from lifecycle import GrammarKind, GrammarSpec, SamplingParams
from lifecycle.prefill import as_stop_strings
from scheduler.sample.constraint import GrammarError
from scheduler.sample.grammar import check as check_grammar
from scheduler.service.config import BadRequest
from scheduler.service.schema import SamplingParamsBody

#: SGLang sampling fields pdlife cannot honour, with the value that asks for nothing.
NEUTRAL: dict[str, Any] = {
    "structural_tag": None,
    "custom_params": None,
    "spaces_between_special_tokens": True,
}

#: A token id as a ``logit_bias`` key: decimal digits, without a leading zero.
_TOKEN_KEY = re.compile(r"0|[1-9][0-9]*")
#: The deepest a JSON schema may nest (objects and arrays): real schemas nest a few levels; a
#: deeper one is refused before it is read (reading and compiling recurse).
MAX_SCHEMA_DEPTH = 128
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')

#: The most samples (``n``) one request may ask for per prompt.
MAX_N = 16

_SEEDS = 1 << 64

#: The structured-output fields, at most one of which a request may set.
GRAMMAR_FIELDS: dict[str, GrammarKind] = {
    "json_schema": GrammarKind.JSON_SCHEMA,
    "regex": GrammarKind.REGEX,
    "ebnf": GrammarKind.EBNF,
}


def sampling_params_from(
    sp: SamplingParamsBody,
    *,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    logprob_start_len: int = -1,
    token_ids_logprob: Sequence[int] = (),
    max_new_tokens_limit: int = 1 << 20,
    grammar_check: Callable[[GrammarSpec], None] = check_grammar,
) -> SamplingParams:
    """The request's :class:`SamplingParams`, or :class:`BadRequest` naming the field to change
    (reason ``unsupported`` for a field pdlife cannot honour, ``bad_grammar`` for a grammar
    that does not parse or compile (``grammar_check`` compiles it: the server's compiler, whose
cache the engines then copy it from), ``bad_sampling`` for a value out of range). The server's own
    limits beyond ``max_new_tokens_limit`` (the prompt and the answer against the context and
    the pool) are :func:`~.config.check_item`'s."""
    refuse_unsupported(sp)
    if sp.max_new_tokens > max_new_tokens_limit:  # the schema refuses a negative one
        raise BadRequest("bad_max_new_tokens", "sampling_params.max_new_tokens must be at most "
                         f"{max_new_tokens_limit}, got {sp.max_new_tokens}")
    if sp.top_k == 0 or sp.top_k < -1 or sp.top_k > 1 << 31:
        raise BadRequest("bad_sampling", "sampling_params.top_k must be -1 (no limit) or "
                         f"1..{1 << 31}, got {sp.top_k}")
    stop = as_stop_strings(sp.stop or ())
    if "" in stop:
        raise BadRequest("bad_sampling", "sampling_params.stop: a stop string must not be empty")
    if sp.min_new_tokens > sp.max_new_tokens:
        raise BadRequest("bad_sampling", "sampling_params.min_new_tokens must be at most "
                         f"sampling_params.max_new_tokens ({sp.max_new_tokens}), got "
                         f"{sp.min_new_tokens}")
    stop_ids = tuple(sp.stop_token_ids or ())
    if min(stop_ids, default=0) < 0:
        raise BadRequest("bad_stop_token", "sampling_params.stop_token_ids must be >= 0")
    try:
        return SamplingParams(
            # 0 (the prompt alone): the engines run the one token of a prefill and the answer
            # writes none (:attr:`~.config.AnswerOptions.prompt_only`).
            max(sp.max_new_tokens, 1), stop_ids, sp.ignore_eos,
            temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0), min_p=sp.min_p,
            seed=sp.sampling_seed, stop=stop, stop_regex=as_stop_strings(sp.stop_regex or ()),
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
            grammar=grammar_of(sp, grammar_check), frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty,
            min_new_tokens=sp.min_new_tokens, logit_bias=logit_bias_of(sp),
            token_ids_logprob=token_ids_logprob,
        )
    except ValueError as exc:  # SamplingParams' own range checks
        raise BadRequest("bad_sampling", f"sampling_params.{exc}") from exc


def refuse_unsupported(sp: SamplingParamsBody) -> None:
    """:class:`BadRequest` for the first field pdlife cannot honour that asks for something."""
    for name, neutral in NEUTRAL.items():
        value = getattr(sp, name)
        if value != neutral and not (neutral is None and value in ({}, [], "")):
            raise BadRequest("unsupported", unsupported(f"sampling_params.{name}", value,
                                                        neutral))


def unsupported(field: str, value: Any, neutral: Any) -> str:
    """What a refusal of ``field`` says: the value asked for (when it is short), the one that
    asks for nothing, both as JSON."""
    asked = f"={json.dumps(value)}" if isinstance(value, bool | int | float | str) else ""
    return (f"{field}{asked} is not supported by this server (leave it out, or send "
            f"{json.dumps(neutral)})")


def logit_bias_of(sp: SamplingParamsBody) -> dict[int, float]:
    """``logit_bias`` by token id (its keys are token ids written in decimal, as in SGLang's
    and OpenAI's APIs: ``"5"``, not ``"05"``, ``" 5"`` or ``"5_0"``, so no two keys name one
    token); the ids against the vocabulary are :func:`~.config.check_item`'s."""
    bias: dict[int, float] = {}
    for key, value in (sp.logit_bias or {}).items():
        if not _TOKEN_KEY.fullmatch(key):
            raise BadRequest("bad_sampling", "sampling_params.logit_bias: keys are token ids "
                             f"in decimal, got {key!r}")
        bias[int(key)] = value
    return bias


def _nesting(source: str) -> int:
    """How deep the objects and arrays of JSON text ``source`` nest (its strings left out)."""
    text = np.frombuffer(_JSON_STRING.sub("", source).encode(errors="replace"), dtype=np.uint8)
    opens = (text == ord("{")) | (text == ord("["))
    closes = (text == ord("}")) | (text == ord("]"))
    return int(np.cumsum(opens.astype(np.int64) - closes).max(initial=0))


def grammar_of(sp: SamplingParamsBody,
               check: Callable[[GrammarSpec], None] = check_grammar) -> GrammarSpec | None:
    """The request's structured-output constraint, checked: at most one grammar field, a JSON
    schema that parses, and a grammar ``check`` accepts."""
    given = {name: getattr(sp, name) for name in GRAMMAR_FIELDS if getattr(sp, name) is not None}
    if len(given) > 1:
        names = [f"sampling_params.{name}" for name in given]
        raise BadRequest("bad_grammar", f"{names[1]}: give at most one grammar field, got "
                         f"{' and '.join(names)}")
    if not given:
        return None
    ((name, source),) = given.items()
    if name == "json_schema":
        if _nesting(source) > MAX_SCHEMA_DEPTH:
            raise BadRequest("bad_grammar", "sampling_params.json_schema is nested too deeply "
                             f"(more than {MAX_SCHEMA_DEPTH} levels)")
        try:
            schema = json.loads(source)
        except ValueError as exc:  # not JSON, or an integer beyond Python's digit limit
            raise BadRequest("bad_grammar",
                             f"sampling_params.json_schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise BadRequest("bad_grammar", "sampling_params.json_schema must be a JSON schema "
                             f"(an object or a boolean), got {type(schema).__name__}")
    spec = GrammarSpec(GRAMMAR_FIELDS[name], source)
    try:
        check(spec)
    except RecursionError:
        raise BadRequest("bad_grammar", f"sampling_params.{name} is nested too deeply to "
                         "compile") from None
    except GrammarError as exc:
        # The message starts with the grammar's kind, the field's name: "regex does not ..."
        raise BadRequest("bad_grammar", f"sampling_params.{exc}") from exc
    return spec



def samples_per_prompt(params: list[SamplingParamsBody]) -> int:
    """The ``n`` of a request's prompts (one for all of them), or :class:`BadRequest` (reason
    ``bad_sampling``) when it is beyond :data:`MAX_N` (whether the request's samples could be
    queued at all: :func:`.shedding.check_queueable`)."""
    ns = {sp.n for sp in params}
    if len(ns) > 1:
        raise BadRequest("bad_batch", "the prompts of a batch must ask for the same "
                         f"sampling_params.n, got {sorted(ns)}")
    (n,) = ns
    if not 1 <= n <= MAX_N:
        raise BadRequest("bad_sampling", f"sampling_params.n must be in 1..{MAX_N}, got {n}")
    return n


def per_choice(value: Any, prompts: int, n: int, name: str) -> list[Any]:
    """A bootstrap field's value for each of a request's ``prompts`` x ``n`` choices
    (prompt-major), from one value for all of them, one per prompt, or one per choice. A room
    given once for several choices is spread over them as SGLang does: the ``i``-th choice it
    covers takes ``room + i`` (mod 2**64), so both workers of a pair derive the same rooms from
    what the router sent once; a host or port is repeated. :class:`BadRequest` (``bad_batch``)
    for a list of another length."""
    total = prompts * n
    if not isinstance(value, list):
        values, per = [value], total
    elif len(value) == total:
        return value
    elif len(value) == prompts:
        values, per = value, n
    else:
        raise BadRequest("bad_batch", f"{name} has {len(value)} entries for {prompts} prompts "
                         f"of {n} samples each (give one value, one per prompt or one per "
                         "sample)")
    if name != "bootstrap_room":
        return [v for v in values for _ in range(per)]
    return [(v + i) % _SEEDS if _a_room(v) else v for v in values for i in range(per)]


def _a_room(value: Any) -> bool:
    """An unsigned 64-bit room: anything else is left for the item's check to refuse."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _SEEDS


def check_own_rooms(targets: Iterable[tuple[str | None, int | None, int | None]]) -> None:
    """:class:`BadRequest` (``bad_batch``) when two items of one request (prompts of a batch,
    or samples of ``n``) name the same bootstrap room of one decode peer (``(host, port, room)``):
    the second would be refused as a room in use, and unseeded samples would draw alike."""
    given = [t for t in targets if t[2] is not None]
    if len(set(given)) != len(given):
        raise BadRequest("bad_batch", "bootstrap_room: every prompt and every one of the n "
                         "samples needs a room of its own; send a list of distinct rooms")


def sample(sp: SamplingParamsBody, i: int) -> SamplingParamsBody:
    """Sample ``i``'s sampling fields (of ``sp.n``): one answer, seeded ``sampling_seed + i``
    (mod 2**64) when a seed is given; without one each sample's own bootstrap room seeds it."""
    seed = None if sp.sampling_seed is None else (sp.sampling_seed + i) % _SEEDS
    return sp.model_copy(update={"n": 1, "sampling_seed": seed})
