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
  tool-call parser reads (``pdlife serve --tool-call-parser``, :mod:`.tool_formats`); the
  text outside the calls is the content, finish ``tool_calls`` when there is a call. A format
  whose tags are special tokens reads the answer with them (``skip_special_tokens`` off).
  Without a parser ``auto`` is refused (400), never answered as plain text;
- **none**: the answer is text.

A forced call is compact JSON unless its parameters' ``x-guidance`` says otherwise. An answer
cut by ``max_tokens`` says ``length``: a named call cut short is answered as content, a list of
calls keeps its complete ones, and ``auto`` leaves out the call the cut lost. A stream sends
content as it comes (``auto``: up to where calls may begin) and the calls in one chunk at the end.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from scheduler.service import tool_formats
from scheduler.service.openai_schema import ChatCompletionRequest, FunctionCall, Tool, ToolCall

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
    schema that forces it (None: no grammar), the tools for the chat template, whether the
    answer is read with its special tokens (the format's tags are special tokens)."""

    answer: ToolAnswer | None = None
    schema: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    keep_special_tokens: bool = False


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
                f"--tool-call-parser, one of {', '.join(tool_formats.FORMATS)}); or send "
                "tool_choice required or a named function: a grammar forces those calls, "
                "whatever the model's format", "tool_choice")
        name = tool_formats.canonical(parser)
        special = tool_formats.FORMATS[name].special_tags
        return ToolPlan(ToolAnswer("auto", parser=name), tools=template_tools,
                        keep_special_tokens=special)
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


#: Keywords whose values are data, not schemas: a ``$ref`` key in them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _moved(node: Any, root: str) -> Any:
    """``node`` with its local references (``#``, ``#/...``) made relative to ``root``, the
    place the schema they belong to moved to. A schema with an ``$id`` is a resource of its
    own, against which the references inside it resolve wherever it is: left as it is."""
    if isinstance(node, list):
        return [_moved(item, root) for item in node]
    if not isinstance(node, dict) or "$id" in node:
        return node
    out = {key: value if key in _DATA_KEYWORDS else _moved(value, root)
           for key, value in node.items()}
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
    (a forced answer cut short, or an answer without a call) is content. An answer cut by
    ``max_tokens`` keeps its complete calls and says ``length``."""
    if tool.mode == "auto":
        cut = finish_reason == "length"
        found = tool_formats.FORMATS[tool.parser].find(text, cut=cut)
        calls = tuple(_call(name, arguments) for name, arguments in found.calls)
        if not calls:
            # Before a call the cut began, content of whitespace alone is none.
            dropped = found.content != text
            return ReadAnswer(None if dropped and not found.content.strip() else found.content,
                              (), finish_reason)
        # An answer cut by max_tokens says so, calls or not (a call after the cut may be missing).
        return ReadAnswer(found.content if found.content.strip() else None, calls,
                          "length" if cut else "tool_calls")
    if tool.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return ReadAnswer(text, (), finish_reason)
        return ReadAnswer(None, (_call(tool.name, text.strip()),), finish_reason)
    found_calls, _ = tool_formats.json_array_calls(text, ("parameters",), strict=True)
    if not found_calls:
        return ReadAnswer(text, (), finish_reason)
    # A small model may repeat calls until max_tokens cuts the list: the complete ones stand.
    return ReadAnswer(None, tuple(_call(name, arguments) for name, arguments in found_calls),
                      "length" if finish_reason == "length" else "tool_calls")


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
    answer (the calls come at the end), and for ``auto`` the text up to where calls may begin
    (a piece that may begin them is held back)."""

    def __init__(self, tool: ToolAnswer) -> None:
        self._tool = tool
        self._text = ""
        self._sent = 0
        self._stopped = tool.mode != "auto"

    @property
    def may_write_text(self) -> bool:
        """Whether the answer may hold content (``auto``), not only calls."""
        return self._tool.mode == "auto"

    def more(self, delta: str) -> str:
        """What of ``delta`` (the answer's next text) to send now."""
        if self._stopped:
            return ""
        self._text += delta
        end, self._stopped = tool_formats.FORMATS[self._tool.parser].content_end(self._text)
        if not self._text[:end].strip():
            end = 0  # content only whitespace before calls is none: wait for more
        out = self._text[self._sent : max(end, self._sent)]
        self._sent += len(out)
        return out

    def end(self, text: str, finish_reason: str) -> tuple[str, ReadAnswer]:
        """The content not sent yet and the answer read, once ``text`` is the whole answer."""
        answer = read(self._tool, text, finish_reason)
        sent = self._text[: self._sent]
        content = answer.content or ""
        return content[len(sent):] if content.startswith(sent) else "", answer
