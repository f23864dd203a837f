"""SGLang's request endpoints: ``/generate`` (one prompt or a batch, plain or streamed) and
``/abort_request``.

Handlers never touch an engine: they check the input (:meth:`Service.check`), then admit, wait
and stream through :mod:`.handoff` (register and submit, await the request's future; see
:mod:`.core` for the hand-off). A client that goes away aborts its requests.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lifecycle import TOKEN_IDS_LOGPROB_MAX, SamplingParams
from scheduler.messages import TokenLogprob
from scheduler.sample.stops import StopRegexTooSlow
from scheduler.service import handoff
from scheduler.service.answers import (
    LOGPROB_KEYS,
    IncrementalText,
    answer_body,
    final_body,
    final_text,
    finish_reason,
    logprob_fields,
)
from scheduler.service.config import MAX_RID_LEN, Answer, AnswerOptions
from scheduler.service.core import BadRequest, Item, Pending, Service
from scheduler.service.errors import error, failure_kind, rejected
from scheduler.service.openai_format import StreamText
from scheduler.service.pending import Progress
from scheduler.service.routes_info import ServiceDep
from scheduler.service.sampling import (
    check_own_rooms,
    per_choice,
    sample,
    samples_per_prompt,
    sampling_params_from,
)
from scheduler.service.schema import (
    ERRORS,
    AbortAnswer,
    AbortBody,
    ErrorBody,
    ErrorDetail,
    GenerateAnswer,
    GenerateRequest,
    SamplingParamsBody,
)
from scheduler.service.shedding import check_queueable

logger = logging.getLogger(__name__)

router = APIRouter()


# -- input ------------------------------------------------------------------------------------


def _per_item(value: Any, n: int, name: str, many: bool) -> list[Any]:
    """A batch field: one value per prompt, or one value shared by all."""
    if isinstance(value, list):
        if not many:
            raise BadRequest("bad_batch", f"{name} is a list but the prompt is not a batch "
                             "and asks for one sample")
        if len(value) != n:
            raise BadRequest("bad_batch", f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _items(service: Service, body: GenerateRequest) -> tuple[list[Item], bool]:
    """The checked items of a body (``n`` of them per prompt, prompt-major), and whether the
    answer is a list (a batch, or ``n`` > 1, which cannot be streamed)."""
    _refuse_unsupported(body)
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("bad_prompt", "give exactly one of text or input_ids")
    prompts: list[list[int]]
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [service.tokenizer.encode(t) for t in texts]
    else:
        ids = body.input_ids
        assert ids is not None
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batch else [list(ids)]  # type: ignore[arg-type]
    if batch and not prompts:
        raise BadRequest("empty_prompt", "the batch is empty")
    count = len(prompts)
    given = body.sampling_params
    params = _per_item(SamplingParamsBody() if given is None else given, count,
                       "sampling_params", batch)
    n = samples_per_prompt(params)
    check_queueable(count, n, service.config.max_queued_requests)
    many = batch or n > 1
    asked = _asked_ids(body, count, batch)
    if isinstance(body.rid, list):
        rids = _per_item(body.rid, count, "rid", batch)
    elif body.rid is not None:
        rids = [body.rid] if not batch else [f"{body.rid}-{i}" for i in range(count)]
    else:
        base = uuid.uuid4().hex
        rids = [base] if not batch else [f"{base}-{i}" for i in range(count)]
    if n > 1:  # SGLang's: each prompt's samples are prompt-major, ``<rid>_<i>``
        rids = [f"{rid}_{i}" for rid in rids for i in range(n)]
        prompts = [prompt for prompt in prompts for _ in range(n)]
        params = [sample(sp, i) for sp in params for i in range(n)]
        asked = [ids for ids in asked for _ in range(n)]
    total = len(rids)
    if len(set(rids)) != total:
        raise BadRequest("duplicate_rid", "the rids of a batch must be distinct", param="rid")
    hosts, ports, rooms = (_bootstrap(body, name, count, n, many) for name in (
        "bootstrap_host", "bootstrap_port", "bootstrap_room"))
    check_own_rooms(zip(hosts, ports, rooms, strict=True))
    items = [
        attrs.evolve(service.check(
            rid=rid, input_ids=prompt, sampling=_sampling(service, body, sp, rid, ids),
            bootstrap_host=host, bootstrap_port=port, bootstrap_room=room,
        ), options=AnswerOptions(sp.no_stop_trim, sp.skip_special_tokens,
                                 body.return_text_in_logprobs,
                                 prompt_only=sp.max_new_tokens == 0))
        for rid, prompt, sp, ids, host, port, room in zip(
            rids, prompts, params, asked, hosts, ports, rooms, strict=True
        )
    ]
    if body.stream and many:
        raise BadRequest("bad_batch", "streaming a batch (or n > 1) is not supported")
    return service.prepare_grammars(items), many


def _bootstrap(body: GenerateRequest, name: str, count: int, n: int, many: bool) -> list[Any]:
    """The bootstrap field ``name`` of each of the ``count`` x ``n`` items (see
    :func:`~.sampling.per_choice`)."""
    value = getattr(body, name)
    if isinstance(value, list) and not many:
        raise BadRequest("bad_batch", f"{name} is a list but the prompt is not a batch and "
                         "asks for one sample")
    return per_choice(value, count, n, name)


def _asked_ids(body: GenerateRequest, count: int, batch: bool) -> list[tuple[int, ...]]:
    """Each prompt's ``token_ids_logprob``: one list for all, or (a batch) one per prompt; an
    empty list asks for none."""
    given = body.token_ids_logprob
    if not given:
        return [()] * count
    if not body.return_logprob:
        raise BadRequest("bad_sampling", "token_ids_logprob needs return_logprob: true")
    if not isinstance(given[0], list):
        lists = [tuple(given)] * count  # ints, by the schema
    elif not batch:
        raise BadRequest("bad_batch", "token_ids_logprob: a list of lists is a batch's, one "
                         "per prompt; for one prompt give a list of token ids")
    elif len(given) != count:
        raise BadRequest("bad_batch", f"token_ids_logprob has {len(given)} lists for a batch "
                         f"of {count} prompts (give one list of ids for all, or one per prompt)")
    else:
        lists = [tuple(ids) for ids in given]  # id lists, by the schema
    longest = max(len(ids) for ids in lists)
    if longest > TOKEN_IDS_LOGPROB_MAX:
        raise BadRequest("bad_sampling", f"token_ids_logprob: at most {TOKEN_IDS_LOGPROB_MAX} "
                         f"token ids per prompt, got {longest}")
    return lists


def _sampling(service: Service, body: GenerateRequest, sp: SamplingParamsBody,
              rid: str, asked: tuple[int, ...]) -> SamplingParams:
    try:
        return sampling_params_from(
            sp, return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len, token_ids_logprob=asked,
            max_new_tokens_limit=service.config.new_tokens_limit,
            grammar_check=service.check_grammar)
    except BadRequest as exc:
        exc.rid = rid
        raise


#: Top-level SGLang fields pdlife cannot honour, with the value that asks for nothing.
_NEUTRAL_TOP: dict[str, Any] = {
    "return_hidden_states": False, "input_embeds": None,
    "image_data": None, "audio_data": None, "video_data": None, "lora_path": None,
    "custom_logit_processor": None, "session_params": None,
}


def _refuse_unsupported(body: GenerateRequest) -> None:
    for name, neutral in _NEUTRAL_TOP.items():
        value = getattr(body, name)
        if value != neutral:
            raise BadRequest("unsupported", f"{name} is not supported by this server "
                             f"(leave it out, or send {json.dumps(neutral)})")


# -- routes -----------------------------------------------------------------------------------


@router.post("/abort_request", response_model=AbortAnswer,
             responses={400: ERRORS[400], 404: {"model": ErrorBody,
                                                  "description": "no live request has this rid"}})
async def abort_request(body: AbortBody, service: ServiceDep) -> Response:
    """Abort a live request by rid, and every live request spawned by the request the client
    sent with that rid (its samples, its batch's items); or every live request with
    ``abort_all``."""
    if body.abort_all:
        return JSONResponse(AbortAnswer(rid="", aborted=service.abort_all()).model_dump())
    if not body.rid:
        return rejected(service, "bad_rid", 400, "give a rid, or abort_all: true")
    if len(body.rid) > MAX_RID_LEN:  # no live request has it, and it is not echoed back
        return rejected(service, "bad_rid", 400, f"rid must be 1..{MAX_RID_LEN} characters, "
                        f"got {len(body.rid)}")
    aborted = service.abort_request(body.rid)
    if not aborted:
        return rejected(service, "unknown_rid", 404, f"no live request has rid {body.rid!r}",
                        body.rid)
    return JSONResponse(AbortAnswer(rid=body.rid, aborted=aborted).model_dump())


@router.post(
    "/generate",
    response_model=GenerateAnswer | list[GenerateAnswer],
    responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
              "description": "the answer (a list for a batch or n > 1), or a stream of answers"},
        **ERRORS,
    },
)
async def generate(body: GenerateRequest, request: Request, service: ServiceDep) -> Response:
    """Generate for one prompt or a batch, ``sampling_params.n`` answers each (SGLang's
    ``/generate``)."""
    try:
        items, batch = await handoff.checked(service, body, lambda: _items(service, body))
        started = await handoff.admit(service, request, items, stream=body.stream)
    except handoff.Refusal as refusal:
        handoff.count(service, refusal)
        return error(refusal.status, refusal.kind, str(refusal), refusal.rid)
    if body.stream:
        return StreamingResponse(handoff.events(service, started, _chunks(service, started[0])),
                                 media_type="text/event-stream")
    answers = await handoff.answered(service, request, started, lambda a: error(
        a.status, failure_kind(a), a.message, a.rid))
    if isinstance(answers, Response):
        return answers
    try:
        bodies = [final_body(service.tokenizer, p.item, a)
                  for p, a in zip(started, answers, strict=True)]
    except StopRegexTooSlow as exc:  # cutting the answer at its stop ran past the budget
        return error(400, "rejected", str(exc), started[0].item.rid)
    return JSONResponse(bodies if batch else bodies[0])


async def _chunks(service: Service, pending: Pending
                  ) -> AsyncIterator[dict[str, Any] | handoff.Encoded]:
    """SGLang's stream: cumulative ``text``/``output_ids`` per chunk and, when asked, the
    logprob fields of the answer so far (SGLang's ``meta_info`` of a stream that is not
    incremental), or with ``--incremental-streaming-output`` only what each chunk adds; the
    last one with its ``finish_reason`` (or an error)."""
    chunks = (_incremental_chunks if service.config.incremental_streaming_output
              else _cumulative_chunks)
    try:
        async for chunk in chunks(service, pending):
            yield chunk
    except StopRegexTooSlow as exc:  # its text cannot be cut in time: the request fails
        service.abort(pending.item.rid)
        await pending.future  # its answer, the abort's, lands before the stream ends
        yield ErrorBody(error=ErrorDetail(message=str(exc), type="rejected",
                                          rid=pending.item.rid)).model_dump()


def _last_chunk(pending: Pending) -> dict[str, Any] | None:
    """The error chunk of a request that failed; None for one that ended well."""
    answer = pending.future.result()
    if answer.status == 200:
        return None
    return ErrorBody(error=ErrorDetail(
        message=answer.message, type=failure_kind(answer), rid=answer.rid)).model_dump()


async def _cumulative_chunks(service: Service, pending: Pending
                             ) -> AsyncIterator[dict[str, Any] | handoff.Encoded]:
    body = _CumulativeBody(service.tokenizer, pending)
    async for progress in handoff.new_tokens(pending):
        yield body.more(progress)
    failed = _last_chunk(pending)
    yield failed if failed is not None else final_body(service.tokenizer, pending.item,
                                                       pending.future.result())


async def _incremental_chunks(service: Service, pending: Pending
                              ) -> AsyncIterator[dict[str, Any]]:
    """Each chunk with the text, ``output_ids`` and logprob entries it adds (the input
    logprobs with the first); the text only once it cannot change (:class:`StreamText`: a
    character still open, a tail that may become a stop string, a last token that may be a stop
    token wait), so the chunks' texts add up to the unstreamed answer's. ``meta_info``'s counts
    are the answer's so far, as SGLang's."""
    tokenizer, item = service.tokenizer, pending.item
    text = StreamText(tokenizer, item)
    sent = 0  # output tokens the chunks carried

    def chunk(ids: Sequence[int], delta: str, logprobs: Sequence[TokenLogprob], *,
              cached_tokens: int, answer: Answer | None = None) -> dict[str, Any]:
        body = answer_body(
            tokenizer, item, ids=ids, text=delta, prompt_tokens=len(item.input_ids),
            latency=time.monotonic() - pending.started if answer is None else answer.e2e_latency,
            finish=None if answer is None else finish_reason(answer),
            cached_tokens=cached_tokens, output_logprobs=logprobs,
            input_logprobs=() if sent else (
                pending.input_logprobs if answer is None else answer.input_logprobs))
        body["meta_info"]["completion_tokens"] = sent + len(ids)
        return body

    async for progress in handoff.new_tokens(pending):
        body = chunk(progress.tokens, text.more(progress.tokens), progress.logprobs,
                     cached_tokens=progress.cached_tokens)
        sent += len(progress.tokens)
        yield body
    failed = _last_chunk(pending)
    if failed is not None:
        yield failed
        return
    answer = pending.future.result()
    yield chunk(answer.output_ids[sent:], text.rest(final_text(tokenizer, item, answer)),
                answer.output_logprobs[sent:], cached_tokens=answer.cached_tokens,
                answer=answer)


#: The keys of the logprob fields that grow with the output.
_OUTPUT_KEYS = frozenset(k for k in LOGPROB_KEYS if k.startswith("output_"))


class _CumulativeBody:
    """The chunks of a stream that is not incremental, each the answer so far, built from what
    each pass adds: the text by :class:`IncrementalText`, the ``output_ids`` and output logprob
    entries as the JSON of the chunk before and the new entries' (a chunk's JSON is what
    dumping the answer so far, :func:`answer_body`, writes), so a chunk costs the new tokens'
    work and copying the answer's JSON, not decoding and converting it all again."""

    def __init__(self, tokenizer: Any, pending: Pending) -> None:
        self.tokenizer = tokenizer
        self.pending = pending
        self.text = IncrementalText(tokenizer, pending.item)
        self.ids = 0
        self.ids_json = ""  # the output ids so far, as JSON within the list's brackets
        # Each logprob key's entries so far, likewise, in the order of logprob_fields.
        self.lists = dict.fromkeys(logprob_fields(tokenizer, pending.item, (), ()), "")
        self._inputs: tuple[TokenLogprob, ...] | None = None  # whose entries lists hold

    def more(self, progress: Progress) -> handoff.Encoded:
        """The chunk after ``progress``."""
        item, pending = self.pending.item, self.pending
        # A character still open (its last byte-fallback pieces to come) waits: each chunk's
        # text begins the next one's.
        text = self.text.more(progress.tokens).rstrip("\ufffd")
        self.ids += len(progress.tokens)
        self.ids_json = _extended(self.ids_json, map(str, progress.tokens))
        if self._inputs is not pending.input_logprobs:  # set before the first tokens come
            self._inputs = pending.input_logprobs
            for key, entries in logprob_fields(self.tokenizer, item, self._inputs,
                                               ()).items():
                if key not in _OUTPUT_KEYS:
                    self.lists[key] = ", ".join(map(json.dumps, entries))
        for key, entries in logprob_fields(self.tokenizer, item, (),
                                           progress.logprobs).items():
            if key in _OUTPUT_KEYS:
                self.lists[key] = _extended(self.lists[key], map(json.dumps, entries))
        body = answer_body(self.tokenizer, item, ids=(), text=text,
                           prompt_tokens=len(item.input_ids),
                           latency=time.monotonic() - pending.started, finish=None,
                           cached_tokens=progress.cached_tokens)
        meta = body["meta_info"]
        meta["completion_tokens"] = self.ids
        for key in self.lists:
            del meta[key]  # the last keys: written below from their JSON
        lists = "".join(f", {json.dumps(key)}: [{value}]" for key, value in self.lists.items())
        return handoff.Encoded(f'{{"text": {json.dumps(text)}, "output_ids": [{self.ids_json}], '
                               f'"meta_info": {json.dumps(meta)[:-1]}{lists}}}}}')


def _extended(listed: str, more: Iterable[str]) -> str:
    """The inside of a JSON list, ``listed``, with the JSON values ``more`` after."""
    added = ", ".join(more)
    if not added:
        return listed
    return f"{listed}, {added}" if listed else added
