"""From an OpenAI request body to the checked :class:`~.config.Item` the engines run.

The prompt: ``/v1/completions`` takes a text (encoded as ``/generate`` encodes ``text``) or
token ids, or a batch of either (``n`` choices per prompt, prompt-major, as ``/generate``'s
batches); ``/v1/chat/completions`` renders its messages with the model's chat template and
encodes the result. ``echo`` asks for the prompt's text before each answer's and, with
``logprobs``, the prompt's logprobs from its first position on (``logprob_start_len`` 0).

The sampling fields are renamed into SGLang's ``sampling_params`` (``max_tokens`` →
``max_new_tokens``, ``seed`` → ``sampling_seed``, ``response_format`` → ``json_schema``) and
go through :func:`~.sampling.sampling_params_from`, the one place that decides what pdlife
honours; its refusals come back under the OpenAI field's name. Fields only the OpenAI API has
that pdlife cannot honour (``suffix``, ``best_of``, ...) are refused here when they ask for
something. A chat's ``tools`` and ``tool_choice`` are planned by :mod:`.openai_tools`: the
tools go to the chat template, and a forced call becomes the answer's JSON schema.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
from jinja2.exceptions import TemplateError
from pydantic import ValidationError

from lifecycle import SamplingParams
from scheduler.service import openai_tools
from scheduler.service.answers import decode
from scheduler.service.config import AnswerOptions, BadRequest, ContextTooLong, Item
from scheduler.service.core import Service
from scheduler.service.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OtherPart,
    RefusalPart,
    SamplingFields,
    TextPart,
)
from scheduler.service.sampling import (
    check_own_rooms,
    per_choice,
    sample,
    samples_per_prompt,
    sampling_params_from,
    unsupported,
)
from scheduler.service.schema import SamplingParamsBody
from scheduler.service.shedding import check_queueable

#: OpenAI fields pdlife cannot honour, with the values that ask for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "return_hidden_states": (False,),
    "spaces_between_special_tokens": (None, True),
    "lora_path": (None, ""),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "continue_final_message": (False,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "chat_template_kwargs": (None, {}),
    "modalities": (None, ["text"]),
    "audio": (None,),
}

#: What to use instead, for the refusals that have an answer.
_INSTEAD = {
    "functions": "; functions and function_call are OpenAI's older names: send tools and "
                 "tool_choice",
    "function_call": "; functions and function_call are OpenAI's older names: send tools and "
                     "tool_choice",
}

_SGLANG_FIELD = re.compile(r"sampling_params\.(\w+)")


class FieldError(BadRequest):
    """A refusal that names the request field to change (OpenAI's ``param``) as it is built."""

    def __init__(self, reason: str, message: str, param: str | None, *,
                 status: int = 400) -> None:
        super().__init__(reason, message, status=status, param=param)


def completion_items(service: Service, body: CompletionRequest) -> list[Item]:
    """The checked items of a ``/v1/completions`` body (``n`` per prompt, prompt-major), or
    :class:`FieldError`."""
    _refuse_unsupported(body)
    logprobs = body.logprobs is not None
    if body.echo and logprobs and service.config.role == "decode":
        raise FieldError("unsupported", "echo with logprobs needs the prompt's logprobs, which "
                         "the prefill side computes and a decode worker does not have (send it "
                         "to a colocated worker, --backend local)", "echo")
    sp = _sampling_body(body, body.max_tokens)
    prompts = _prompts(service, body)
    items = _items(service, body, "cmpl", [ids for ids, _ in prompts], sp, "max_tokens",
                   body.max_tokens, return_logprob=logprobs, top=body.logprobs or 0,
                   logprob_start_len=0 if body.echo and logprobs else -1)
    if not body.echo:
        return items
    # The text sent, or (the ids are checked now) the ids decoded.
    echoes = [text if text is not None else decode(service.tokenizer, ids,
                                                   skip_special_tokens=body.skip_special_tokens)
              for ids, text in prompts]
    n = len(items) // len(prompts)
    return [attrs.evolve(item, options=attrs.evolve(item.options, echo=echoes[k // n]))
            for k, item in enumerate(items)]


def chat_items(service: Service, body: ChatCompletionRequest) -> list[Item]:
    """The checked items of a ``/v1/chat/completions`` body (one per choice), or
    :class:`FieldError`."""
    _refuse_unsupported(body)
    if body.top_logprobs and not body.logprobs:
        raise FieldError("invalid_request", "top_logprobs needs logprobs: true", "top_logprobs")
    try:
        tools = openai_tools.plan(body, service.config.tool_call_parser)
    except openai_tools.ToolChoiceError as exc:
        raise FieldError(exc.reason, str(exc), exc.param) from exc
    prompt = _chat_prompt(service, body, tools.tools)
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = body.max_completion_tokens or body.max_tokens
    max_new = asked if asked is not None else _room_left(service, len(prompt))
    sp = _sampling_body(body, max_new, tools.schema)
    # Without either field the answer asks for what is left, at least the one token every
    # answer has: a refusal for the context counts that one.
    items = _items(service, body, "chatcmpl", [prompt], sp, name,
                   1 if asked is None else asked,
                   return_logprob=body.logprobs, top=body.top_logprobs)
    if tools.answer is None:
        return items
    skip = body.skip_special_tokens and not tools.keep_special_tokens
    return [attrs.evolve(item, options=attrs.evolve(item.options, tools=tools.answer,
                                                    skip_special_tokens=skip))
            for item in items]


# -- prompts ------------------------------------------------------------------------------------


def _prompts(service: Service, body: CompletionRequest
             ) -> list[tuple[list[int], str | None]]:
    """The prompts of a completions body (a batch, or one), each as token ids and, when it
    was sent as text, that text."""
    prompt = body.prompt
    batch: list[Any]  # strings or id lists, by the schema
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        batch = [prompt]  # one text, or one list of token ids (maybe empty)
    else:
        batch = prompt
    if not batch:
        raise FieldError("empty_prompt", "the batch of prompts is empty", "prompt")
    return [(list(service.tokenizer.encode(p)), p) if isinstance(p, str) else (list(p), None)
            for p in batch]


def _text(content: str | list[TextPart | RefusalPart | OtherPart] | None, at: str,
          role: str) -> str:
    """The text of a ``role`` message: its text (and, an assistant's, refusal) parts joined
    with newlines; another kind of part is 400 ``unsupported``, and a refusal part in another
    role's message 400 ``invalid_request``, as OpenAI refuses it (``at`` names the message)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        field = f"{at}.content.{j}.type"
        if isinstance(part, OtherPart):
            raise FieldError("unsupported", f"{field}: {part.type} content is not supported: "
                             "pdlife serves text models", field)
        if isinstance(part, RefusalPart) and role != "assistant":
            raise FieldError("invalid_request", f"{field}: a {role} message ({at}) has a "
                             "refusal part; refusal parts go in assistant messages only (send "
                             "the text as a text part)", field)
        texts.append(part.refusal if isinstance(part, RefusalPart) else part.text)
    return "\n".join(texts)


#: The roles whose messages must have content (an assistant's may be null, as a message that
#: only calls tools is; a ``function`` message is OpenAI's deprecated form).
_CONTENT_REQUIRED = ("system", "developer", "user", "tool")


def _chat_prompt(service: Service, body: ChatCompletionRequest,
                 tools: Sequence[dict[str, Any]]) -> list[int]:
    for i, m in enumerate(body.messages):
        if m.content is None and m.role in _CONTENT_REQUIRED:
            raise FieldError("invalid_request", f"messages.{i}.content: a {m.role} message "
                             "needs content (a string or a list of text parts)",
                             f"messages.{i}.content")
    messages = [openai_tools.template_message(m.role, _text(m.content, f"messages.{i}", m.role),
                                              m.name, m.tool_calls, m.tool_call_id)
                for i, m in enumerate(body.messages)]
    tokenizer = service.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise FieldError("no_chat_template", f"the model {service.config.model_name!r} has no "
                         "chat template: send the prompt to /v1/completions", "messages")
    try:
        return list(tokenizer.encode_chat(messages, tools=tools or None))
    except (ValueError, TypeError, TemplateError) as exc:  # TypeError: a filter misused
        raise FieldError("bad_messages", f"the chat template refused the messages: {exc}",
                         "messages") from exc


def _room_left(service: Service, prompt_tokens: int) -> int:
    """The default answer length of a chat: what the server's limit, the context and (decode)
    the KV pool leave after the prompt; at least 1 (a prompt that leaves nothing is refused
    by the check)."""
    c = service.config
    # The answer's last token takes no position and no KV.
    room = [c.new_tokens_limit, c.max_position - prompt_tokens + 1]
    if c.role != "prefill":
        room.append(c.pool_pages * c.scheduler.page_size - prompt_tokens + 1)
    return max(1, min(room))


# -- sampling -----------------------------------------------------------------------------------


def _refuse_unsupported(body: SamplingFields) -> None:
    for name, neutral in _NEUTRAL.items():
        if name in type(body).model_fields and getattr(body, name) not in neutral:
            raise FieldError("unsupported", unsupported(name, getattr(body, name), neutral[0])
                             + _INSTEAD.get(name, ""), name)


def _constraint(body: SamplingFields) -> dict[str, str]:
    """The body's structured-output constraint under SGLang's name (``json_schema``,
    ``regex`` or ``ebnf``), from OpenAI's ``response_format``, SGLang's ``regex`` and
    ``ebnf``, or vLLM's ``guided_*`` and ``structured_outputs`` fields: at most one."""
    given = body.constraints()
    if len(given) > 1:
        raise FieldError("bad_grammar", f"{given[1][0]}: give at most one constraint, got "
                         f"{given[0][0]} and {given[1][0]}", given[1][0])
    if not given:
        return {}
    field, kind, source = given[0]
    if field == "response_format" and not source:
        raise FieldError("bad_grammar", "response_format json_schema needs "
                         "json_schema.schema", "response_format.json_schema")
    return {kind: source}


#: SGLang's names of the OpenAI fields, as refusals name them.
_NAMES = {"max_new_tokens": "max_tokens", "sampling_seed": "seed",
          "min_new_tokens": "min_tokens", "json_schema": "response_format"}


def _sampling_body(body: SamplingFields, max_new: int,
                   json_schema: str | None = None) -> SamplingParamsBody:
    """``body``'s sampling fields under SGLang's names; ``json_schema`` forces the answer
    (tool calls) instead of ``response_format``'s."""
    constraint = {"json_schema": json_schema} if json_schema else _constraint(body)
    try:
        return SamplingParamsBody(
            max_new_tokens=max_new, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, min_p=body.min_p, sampling_seed=body.seed, stop=body.stop,
            stop_regex=body.stop_regex, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            no_stop_trim=body.no_stop_trim, skip_special_tokens=body.skip_special_tokens,
            json_schema=constraint.get("json_schema"), regex=constraint.get("regex"),
            ebnf=constraint.get("ebnf"),
            n=body.n, frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            min_new_tokens=body.min_tokens or 0, logit_bias=body.logit_bias,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        param = _NAMES.get(field or "", field)
        raise FieldError("invalid_request", f"{param}: {first['msg']}", param) from exc


def _sampling(service: Service, body: SamplingFields, sp: SamplingParamsBody, max_name: str, *,
              return_logprob: bool, top: int, logprob_start_len: int) -> SamplingParams:
    try:
        return sampling_params_from(sp, return_logprob=return_logprob, top_logprobs_num=top,
                                    logprob_start_len=logprob_start_len,
                                    max_new_tokens_limit=service.config.new_tokens_limit,
                                    grammar_check=service.check_grammar)
    except BadRequest as exc:
        names = {**_NAMES, "max_new_tokens": max_name}
        given = body.constraints()
        for field, kind, _ in given[:1]:  # the grammar by the field it came in
            names[kind] = field
        if not given and sp.json_schema is not None:  # a forced tool call's
            names["json_schema"] = "tools"
        raise _renamed(exc, names) from exc


def _renamed(exc: BadRequest, names: dict[str, str]) -> FieldError:
    """``exc`` in the OpenAI field names: ``sampling_params.sampling_seed`` becomes ``seed``."""
    found = _SGLANG_FIELD.search(str(exc))
    field = found.group(1) if found else None
    param = names.get(field, field) if field else None
    message = _SGLANG_FIELD.sub(lambda m: names.get(m.group(1), m.group(1)), str(exc))
    return FieldError(exc.reason, message, param, status=exc.status)


# -- the item -----------------------------------------------------------------------------------


def _items(service: Service, body: SamplingFields, prefix: str, prompts: list[list[int]],
           sp: SamplingParamsBody, max_name: str, asked: int, *, return_logprob: bool,
           top: int, logprob_start_len: int = -1) -> list[Item]:
    """One checked item per choice, ``n`` per prompt, prompt-major: with more than one, choice
    ``k`` (the ``j``-th of its prompt) is request ``<rid>_<k>`` seeded ``seed + j``
    (:func:`~.sampling.sample`), with its own room (:func:`~.sampling.per_choice`).
    ``max_name`` is the field that sets the answer's length and ``asked`` the length the client
    asked for, which a refusal for the context names."""
    try:
        n = samples_per_prompt([sp])
        check_queueable(len(prompts), n, service.config.max_queued_requests)
    except BadRequest as exc:
        renamed = _renamed(exc, _NAMES)
        if exc.reason == "bad_batch":  # a batch of prompts too large: split the prompts
            renamed.param = _prompt_field(prefix)
        raise renamed from exc
    total = n * len(prompts)
    rid = body.rid or f"{prefix}-{uuid.uuid4().hex}"
    fields = []
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        value = getattr(body, name)
        if isinstance(value, list) and total == 1:
            raise FieldError("bad_bootstrap", f"{name} is a list for one choice (give one "
                             "value, or with several choices (n, or a batch of prompts) one per "
                             "prompt or one per choice)", name)
        try:
            fields.append(per_choice(value, len(prompts), n, name))
        except BadRequest as exc:
            raise FieldError("bad_bootstrap", str(exc), name) from exc
    try:
        check_own_rooms(zip(*fields, strict=True))
    except BadRequest as exc:
        raise FieldError("bad_bootstrap", str(exc), "bootstrap_room") from exc
    items = []
    for k, (host, port, room) in enumerate(zip(*fields, strict=True)):
        one = sample(sp, k % n) if n > 1 else sp
        item_rid = f"{rid}_{k}" if total > 1 else rid
        sampling = _sampling(service, body, one, max_name, return_logprob=return_logprob,
                             top=top, logprob_start_len=logprob_start_len)
        items.append(_check(service, item_rid, prompts[k // n], sampling, host, port, room,
                            max_name, asked, prefix))
    options = AnswerOptions(body.no_stop_trim, body.skip_special_tokens,
                            prompt_only=sp.max_new_tokens == 0)
    return [attrs.evolve(item, options=options) for item in items]


def _check(service: Service, rid: str, prompt: list[int], sampling: SamplingParams,
           host: str | None, port: int | None, room: int | None, max_name: str, asked: int,
           prefix: str) -> Item:
    try:
        return service.check(
            rid=rid, input_ids=prompt, sampling=sampling, bootstrap_host=host,
            bootstrap_port=port, bootstrap_room=room,
        )
    except ContextTooLong as exc:
        raise _too_long(exc, rid, prefix, max_name, asked) from exc
    except BadRequest as exc:
        renamed = _renamed(exc, {"max_new_tokens": max_name})
        renamed.rid = rid
        if renamed.param is None and exc.reason in ("empty_prompt", "bad_token_id"):
            renamed.param = _prompt_field(prefix)
        raise renamed from exc


def _prompt_field(prefix: str) -> str:
    return "messages" if prefix == "chatcmpl" else "prompt"


def _too_long(exc: ContextTooLong, rid: str, prefix: str, max_name: str,
              asked: int) -> FieldError:
    """OpenAI's refusal of a request beyond the context, in its words (clients look for the
    code ``context_length_exceeded`` or "maximum context length"), counting the ``asked``
    completion tokens as the client asked for them in ``max_name``; ``param`` is the field to
    change: ``max_name`` when the prompt alone fits this server (the context and the pool),
    else the prompt. Where the KV pool is the limit, the server's context is named, not the
    model's."""
    where = "messages" if prefix == "chatcmpl" else "prompt"
    holder = "server's (its KV pool's)" if exc.pool else "model's"
    error = FieldError(
        "context_length_exceeded",
        f"This {holder} maximum context length is {exc.limit} tokens. However, you requested "
        f"{exc.prompt_tokens + asked} tokens ({exc.prompt_tokens} in the {where}, "
        f"{asked} in the completion). Please reduce the length of the {where} or "
        f"{max_name}. ({exc})",
        max_name if exc.prompt_fits else _prompt_field(prefix))
    error.rid = rid
    error.label = exc.reason
    return error
