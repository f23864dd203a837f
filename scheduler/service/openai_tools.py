"""Tool calls on ``/v1/chat/completions``: what a request's ``tools`` and ``tool_choice`` ask of
the answer, and the calls read back from its text.

The request's tools go to the chat template (its ``tools`` variable, as transformers gives it),
which decides whether and how the model sees them; assistant messages' ``tool_calls`` and tool
messages' ``tool_call_id`` go to it too. Then, by ``tool_choice``:

- a **named function**: the answer is that function's arguments, forced by a JSON-schema
  grammar of its ``parameters`` (none: ``{}``); the message carries the one call, finish
  ``stop`` (OpenAI's finish for a forced function);
- **required**: the answer is a JSON array of ``{"name", "parameters"}`` objects, each one of
  the tools with its parameters, at least one (only one without ``parallel_tool_calls``),
  forced by a JSON-schema grammar (each tool's ``$defs`` moved to the array's); the message
  carries the calls, finish ``tool_calls``;
- **auto** (the default with tools): the model decides, in its own format, which the server's
  tool-call parser reads (``pdlife serve --tool-call-parser``): ``hermes``, the
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks of Hermes and Qwen 2.5
  templates; the text outside them is the content, finish ``tool_calls`` when there is a call.
  Without a parser ``auto`` is refused (400), never answered as plain text;
- **none**: the answer is text.

A forced call is compact JSON unless its parameters' ``x-guidance`` says otherwise. An answer
cut by ``max_tokens`` says ``length``: a named call cut short is answered as content, a list of
calls keeps its complete ones, and ``auto`` leaves out the block the cut lost. A stream sends
content as it comes (``auto``: up to a block's start) and the calls in one chunk at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from scheduler.service.openai_schema import ChatCompletionRequest, FunctionCall, Tool, ToolCall

#: The tool-call formats ``--tool-call-parser`` reads.
TOOL_CALL_PARSERS = ("hermes",)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|\Z)", re.DOTALL)
#: The arguments of a function without ``parameters``: none (OpenAI's empty parameter list).
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}
#: llguidance's JSON options of a forced call: compact JSON (flexible whitespace let a small
#: model pad a call with newlines until max_tokens), unless the parameters set their own.
_COMPACT = {"whitespace_flexible": False}


class ToolChoiceError(ValueError):
    """A ``tools``/``tool_choice`` combination that cannot be served; ``param`` names the field
    to change."""

    def __init__(self, reason: str, message: str, param: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.param = param


@attrs.frozen
class ToolAnswer:
    """How an answer is read for tool calls: ``named`` (``name``'s arguments), ``required``
    (a forced list of calls) or ``auto`` (``parser``'s format in free text)."""

    mode: Literal["named", "required", "auto"]
    name: str = ""
    parser: str = ""


@attrs.frozen
class ToolPlan:
    """What a chat request's tools ask: the answer's reading (None: plain text), the JSON
    schema that forces it (None: no grammar), the tools for the chat template."""

    answer: ToolAnswer | None = None
    schema: str | None = None
    tools: tuple[dict[str, Any], ...] = ()


def plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The tool plan of ``body`` on a server whose tool-call parser is ``parser``; raises
    :class:`ToolChoiceError`."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice in ("none", "auto"):
            return ToolPlan()
        raise ToolChoiceError("invalid_request", "tool_choice needs tools to choose from",
                              "tool_choice")
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolChoiceError("invalid_request", f"tools name {twice[0]!r} more than once",
                              "tools")
    template_tools = tuple(t.model_dump(exclude_none=True) for t in tools)
    if choice == "none":
        return ToolPlan(tools=template_tools)
    if choice == "auto":
        if parser is None:
            raise ToolChoiceError(
                "unsupported", "tool_choice auto (the default with tools) needs a tool-call "
                "parser for the model's format, and this server has none (pdlife serve "
                "--tool-call-parser hermes); send tool_choice required or a named function, "
                "which a grammar forces whatever the model", "tool_choice")
        return ToolPlan(ToolAnswer("auto", parser=parser), tools=template_tools)
    constraints = body.constraints()
    if constraints:
        raise ToolChoiceError("bad_grammar", "tool_choice required or a named function forces "
                              f"the answer's shape itself: drop {constraints[0][0]}",
                              "tool_choice")
    if choice == "required":
        schema = _calls_schema(tools, parallel=body.parallel_tool_calls)
        return ToolPlan(ToolAnswer("required"), json.dumps(schema), template_tools)
    assert not isinstance(choice, str)  # the schema's literals are handled above
    name = choice.function.name
    if name not in names:
        raise ToolChoiceError("invalid_request", f"tool_choice names {name!r}, which is not "
                              f"one of the tools ({', '.join(names)})", "tool_choice")
    parameters = tools[names.index(name)].function.parameters or _NO_ARGUMENTS
    schema = {"x-guidance": _COMPACT, **parameters}
    return ToolPlan(ToolAnswer("named", name=name), json.dumps(schema), template_tools)


def _calls_schema(tools: Sequence[Tool], *, parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each a tool's name and its parameters. Each tool's
    parameters move to the array's ``$defs`` under the tool's name, and their local references
    (``#/$defs/...``: pydantic writes nested models so; ``#`` itself) follow them there. The
    first tool's ``x-guidance`` sets the JSON options (compact without one)."""
    defs: dict[str, Any] = {}
    calls = []
    options: dict[str, Any] | None = None
    for t in tools:
        name = t.function.name
        parameters = dict(t.function.parameters or _NO_ARGUMENTS)
        own = parameters.pop("x-guidance", None)
        options = options or own
        defs[name] = _moved(parameters, f"#/$defs/{name}")
        calls.append({"type": "object",
                      "properties": {"name": {"const": name},
                                     "parameters": {"$ref": f"#/$defs/{name}"}},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                              "$defs": defs, "x-guidance": options or _COMPACT}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _moved(node: Any, root: str) -> Any:
    """``node`` with its local references (``#``, ``#/...``) made relative to ``root``, the
    place the schema they belong to moved to."""
    if isinstance(node, list):
        return [_moved(item, root) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _moved(value, root) for key, value in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


def template_message(role: str, content: str, name: str | None,
                     tool_calls: Sequence[ToolCall] | None,
                     tool_call_id: str | None) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's calls with their arguments as an
    object where they are one (templates write them with ``tojson``), a tool message's id."""
    message: dict[str, Any] = {"role": role, "content": content}
    if name is not None:
        message["name"] = name
    if tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name,
                          "arguments": _object_or_text(call.function.arguments)}}
            for call in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _object_or_text(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


@attrs.frozen
class ReadAnswer:
    """An answer read for tool calls: its content (None when there is none), its calls, its
    finish reason."""

    content: str | None
    calls: tuple[ToolCall, ...]
    finish_reason: str


def read(tool: ToolAnswer, text: str, finish_reason: str) -> ReadAnswer:
    """The calls in ``text``, an answer that finished ``finish_reason``; text that holds none
    (a forced answer cut short, or an answer without a block) is content. An answer cut by
    ``max_tokens`` keeps its complete calls and says ``length``."""
    if tool.mode == "auto":
        return _read_blocks(text, finish_reason)
    if tool.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return ReadAnswer(text, (), finish_reason)
        return ReadAnswer(None, (_call(tool.name, text.strip()),), finish_reason)
    calls = _complete_calls(text)
    if not calls:
        return ReadAnswer(text, (), finish_reason)
    # A small model may repeat calls until max_tokens cuts the list: the complete ones stand.
    return ReadAnswer(None, calls, "length" if finish_reason == "length" else "tool_calls")


def _complete_calls(text: str) -> tuple[ToolCall, ...]:
    """The complete ``{"name", "parameters"}`` elements of a forced array of calls, which may
    be cut short."""
    decoder = json.JSONDecoder()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return ()
    at += 1
    calls: list[ToolCall] = []
    while True:
        at += len(text[at:]) - len(text[at:].lstrip())
        if at >= len(text) or text[at] == "]":
            return tuple(calls)
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:  # the element max_tokens cut
            return tuple(calls)
        if not isinstance(value, dict) or not {"name", "parameters"} <= value.keys():
            return ()
        calls.append(_call(value["name"], value["parameters"]))
        at += len(text[at:]) - len(text[at:].lstrip())
        if text.startswith(",", at):
            at += 1


def _read_blocks(text: str, finish_reason: str) -> ReadAnswer:
    calls: list[ToolCall] = []
    content: list[str] = []
    end = 0
    for block in _BLOCK.finditer(text):
        call = _hermes_call(block.group(1))
        if call is None:
            continue  # not a call: it stays in the content
        content.append(text[end : block.start()])
        calls.append(call)
        end = block.end()
    tail = text[end:]
    if finish_reason == "length":
        # Cut by max_tokens: a block begun and not finished (or its opening tag begun) is the
        # call the cut lost, not content.
        opened = tail.rfind(_OPEN)
        if opened >= 0 and _CLOSE not in tail[opened:]:
            tail = tail[:opened]
        else:
            tail = tail[: len(tail) - _open_tag_begun(tail)]
    content.append(tail)
    joined = "".join(content)
    if not calls:
        return ReadAnswer(joined if joined or finish_reason != "length" else None, (),
                          finish_reason)
    # An answer cut by max_tokens says so, calls or not (a call after the cut may be missing).
    finish = finish_reason if finish_reason == "length" else "tool_calls"
    return ReadAnswer(joined if joined.strip() else None, tuple(calls), finish)


def _open_tag_begun(text: str) -> int:
    """How many of ``text``'s last characters may begin an opening tag."""
    return next((k for k in range(min(len(text), len(_OPEN) - 1), 0, -1)
                 if _OPEN.startswith(text[-k:])), 0)


def _hermes_call(body: str) -> ToolCall | None:
    body = body.rstrip()
    cut = next((k for k in range(len(_CLOSE) - 1, 0, -1) if body.endswith(_CLOSE[:k])), 0)
    try:  # a closing tag cut short (max_tokens) ends the last block as no tag does
        value = json.loads(body[: len(body) - cut])
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _call(value["name"], arguments)


def _call(name: str, arguments: Any) -> ToolCall:
    """A call of ``name``; its arguments as JSON text: text that is JSON as it is, any other
    value written compactly (a string that is not JSON becomes a JSON string)."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            text = arguments
        except ValueError:
            text = json.dumps(arguments, ensure_ascii=False)
    else:
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=text))


class ToolStream:
    """The content of a streamed answer with tool calls, as it may be sent: none for a forced
    answer (the calls come at the end), and for ``auto`` the text up to the first block (a
    piece that may open one is held back)."""

    def __init__(self, tool: ToolAnswer) -> None:
        self._tool = tool
        self._held = ""
        self._sent: list[str] = []
        self._stopped = tool.mode != "auto"

    @property
    def may_write_text(self) -> bool:
        """Whether the answer may hold content (``auto``), not only calls."""
        return self._tool.mode == "auto"

    def more(self, delta: str) -> str:
        """What of ``delta`` (the answer's next text) to send now."""
        if self._stopped:
            return ""
        held = self._held + delta
        at = held.find(_OPEN)
        if at >= 0:
            out, self._stopped = held[:at], True
        else:
            out = held[: len(held) - _open_tag_begun(held)]
        self._held = held[len(out):]
        self._sent.append(out)
        return out

    def end(self, text: str, finish_reason: str) -> tuple[str, ReadAnswer]:
        """The content not sent yet and the answer read, once ``text`` is the whole answer."""
        answer = read(self._tool, text, finish_reason)
        sent = "".join(self._sent)
        content = answer.content or ""
        return content[len(sent):] if content.startswith(sent) else "", answer
