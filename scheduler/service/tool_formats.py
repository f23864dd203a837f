"""The formats models write tool calls in, read for ``tool_choice`` ``"auto"``
(``pdlife serve --tool-call-parser``).

Each format finds the calls in an answer's text, and says how much of an answer still being
written is surely content (what a stream may send before the answer ends):

- ``hermes`` (SGLang's ``qwen25``): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks anywhere in the answer (Hermes 2 and 3, Qwen 2.5); the text around them is content.
- ``llama3`` (vLLM's ``llama3_json``): Llama 3.1 to 3.3's JSON calls, one or more
  ``{"name": ..., "parameters": ...}`` objects separated by ``;``, which begin the answer or
  follow ``<|python_tag|>`` (the text before the tag is content).
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects
  (Mistral 7B v0.3, Mixtral, Mistral Nemo) or by ``name[ARGS]{...}`` calls (later Mistral
  tokenizers); an answer that begins with such an array reads as calls without the tag too.
- ``pythonic`` (Llama 3.2 and 4): a Python list of calls with keyword arguments,
  ``[get_weather(city="Paris"), get_time()]``, which begins the answer or follows
  ``<|python_start|>`` (up to ``<|python_end|>``); arguments are Python literals.

The tags of the last three are special tokens of their models, which decoding drops unless told
otherwise: the server decodes those formats' answers with special tokens (``special_tags``).
A call is what the model wrote, not checked against the request's tools; a block or object that
is not a call stays in the content. An answer cut by ``max_tokens`` (``cut``) keeps its complete
calls, and the call the cut lost (begun, not finished, or a tag begun) is neither call nor
content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Protocol

import attrs

#: A call as read: the function's name and its arguments (JSON text or a value).
Call = tuple[str, Any]


@attrs.frozen
class Found:
    """An answer read: the text that is not calls, and the calls in order."""

    content: str
    calls: tuple[Call, ...] = ()


class ToolFormat(Protocol):
    #: Whether the format's tags are special tokens in its models' vocabularies (the answer is
    #: then decoded with them, ``skip_special_tokens`` off, for the format to find them).
    special_tags: bool

    def find(self, text: str, *, cut: bool) -> Found:
        """The calls in ``text``, a whole answer (``cut``: by ``max_tokens``)."""
        ...

    def content_end(self, text: str) -> tuple[int, bool]:
        """For an answer still being written, ``text`` so far: how many of its first
        characters are content whatever follows, and whether calls may have begun there (the
        rest of the content then waits for the answer's end)."""
        ...


def _tag_begun(text: str, tag: str) -> int:
    """How many of ``text``'s last characters may begin ``tag``."""
    return next((k for k in range(min(len(text), len(tag) - 1), 0, -1)
                 if tag.startswith(text[-k:])), 0)


def _as_call(value: Any, keys: tuple[str, ...], *, strict: bool = False) -> Call | None:
    """``value`` as a call: an object with a string ``name`` and its arguments under the first
    of ``keys`` it has (none: no arguments; ``strict``: not a call)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if strict and not any(k in value for k in keys):
        return None
    arguments: Any = next((value[k] for k in keys if k in value), {})
    return value["name"], arguments


def _skip(text: str, at: int, chars: str = "") -> int:
    """The first index from ``at`` that is neither whitespace nor one of ``chars``."""
    while at < len(text) and (text[at].isspace() or text[at] in chars):
        at += 1
    return at


_DECODER = json.JSONDecoder()


def json_array_calls(text: str, keys: tuple[str, ...], *,
                     strict: bool = False) -> tuple[tuple[Call, ...], int]:
    """The complete calls of a JSON array of call objects beginning ``text`` (which may be cut
    short), and where the array ends (where reading stopped when it does not); no calls when an
    element is not a call (``strict``: one without any of ``keys``)."""
    at = _skip(text, 0)
    if not text.startswith("[", at):
        return (), 0
    at += 1
    calls: list[Call] = []
    while True:
        at = _skip(text, at)
        if at >= len(text):
            return tuple(calls), at
        if text[at] == "]":
            return tuple(calls), at + 1
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:  # the element max_tokens cut
            return tuple(calls), at
        call = _as_call(value, keys, strict=strict)
        if call is None:
            return (), 0
        calls.append(call)
        at = _skip(text, at)
        if text.startswith(",", at):
            at += 1


class _Leading:
    """A format whose calls begin the answer or follow a tag (which decoding may have left out):
    ``opens`` is the first character of calls written at the start."""

    tag: str
    opens: str
    special_tags = True

    def content_end(self, text: str) -> tuple[int, bool]:
        start = _skip(text, 0)
        if start == len(text):
            return 0, False  # only whitespace yet: it may lead into calls
        if text[start] in self.opens:
            return 0, True
        at = text.find(self.tag)
        if at >= 0:
            return at, True
        return len(text) - _tag_begun(text, self.tag), False

    def find(self, text: str, *, cut: bool) -> Found:
        at = text.find(self.tag)
        if at >= 0:
            content, body = text[:at], text[at + len(self.tag):]
        elif text[_skip(text, 0):].startswith(tuple(self.opens)):
            content, body = "", text
        else:
            return Found(text[: len(text) - _tag_begun(text, self.tag)] if cut else text)
        calls, rest = self.calls(body, cut=cut)
        if not calls:
            # Not calls: the answer as written, less the call the cut began (after the tag, or
            # the format's syntax running on to the cut).
            return Found(content if cut and (at >= 0 or self.begun(body)) else text)
        return Found(content if cut else content + rest, calls)

    def calls(self, body: str, *, cut: bool) -> tuple[tuple[Call, ...], str]:
        """The calls at the start of ``body`` and the text after them."""
        raise NotImplementedError

    def begun(self, body: str) -> bool:
        """Whether ``body``, which begins with :attr:`opens` and holds no complete call, is a
        call max_tokens cut (a JSON value cut short), not text."""
        return json_cut(body)


def json_cut(text: str) -> bool:
    """Whether ``text`` (from its first non-blank character) is one JSON value cut short: it
    fails to parse only where it ends (in a string, an escape or between tokens)."""
    try:
        _DECODER.raw_decode(text, _skip(text, 0))
    except json.JSONDecodeError as exc:
        if exc.msg.startswith("Unterminated string"):
            return True
        if exc.msg.startswith("Invalid \\u"):  # an escape cut short: \uXXXX is six
            return len(text) - exc.pos < 6
        return exc.pos >= len(text)
    return False


class Hermes:
    """``<tool_call>{...}</tool_call>`` blocks anywhere in the answer."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    special_tags = False  # added tokens that decoding keeps
    _BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)

    def content_end(self, text: str) -> tuple[int, bool]:
        at = text.find(self.OPEN)
        if at >= 0:
            return at, True
        return len(text) - _tag_begun(text, self.OPEN), False

    def find(self, text: str, *, cut: bool) -> Found:
        calls: list[Call] = []
        content: list[str] = []
        end = 0
        for block in self._BLOCK.finditer(text):
            call = self._call(block.group(1))
            if call is None:
                continue  # not a call: it stays in the content
            content.append(text[end : block.start()])
            calls.append(call)
            end = block.end()
        tail = text[end:]
        if cut:
            # A block begun and not finished (or its opening tag begun) is the call the cut lost.
            opened = tail.rfind(self.OPEN)
            if opened >= 0 and self.CLOSE not in tail[opened:]:
                tail = tail[:opened]
            else:
                tail = tail[: len(tail) - _tag_begun(tail, self.OPEN)]
        content.append(tail)
        return Found("".join(content), tuple(calls))

    def _call(self, body: str) -> Call | None:
        body = body.rstrip()
        cut = _tag_begun(body, self.CLOSE) if not body.endswith(self.CLOSE) else 0
        try:  # a closing tag cut short (max_tokens) ends the last block as no tag does
            value = json.loads(body[: len(body) - cut])
        except ValueError:
            return None
        return _as_call(value, ("arguments", "parameters"))


class Llama3Json(_Leading):
    """JSON call objects separated by ``;`` at the answer's start or after ``<|python_tag|>``."""

    tag = "<|python_tag|>"
    opens = "{"

    def calls(self, body: str, *, cut: bool) -> tuple[tuple[Call, ...], str]:
        calls: list[Call] = []
        at = _skip(body, 0)
        while at < len(body):
            try:
                value, end = _DECODER.raw_decode(body, at)
            except ValueError:  # the object max_tokens cut, or text after the calls
                break
            call = _as_call(value, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            at = _skip(body, end, ";")
        return tuple(calls), body[at:]


class Mistral(_Leading):
    """``[TOOL_CALLS]`` and a JSON array of calls or ``name[ARGS]{...}`` calls; an array alone
    at the answer's start (a tokenizer that leaves the tag out of the text)."""

    tag = "[TOOL_CALLS]"
    opens = "["
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\[ARGS\]")

    def calls(self, body: str, *, cut: bool) -> tuple[tuple[Call, ...], str]:
        if body.lstrip().startswith("["):
            calls, end = json_array_calls(body, ("arguments", "parameters"))
            return calls, body[end:]
        named_calls: list[Call] = []
        at = 0
        while named := self._NAMED.match(body, at):
            try:
                value, end = _DECODER.raw_decode(body, _skip(body, named.end()))
            except ValueError:  # the arguments max_tokens cut
                break
            named_calls.append((named.group(1), value))
            at = _skip(body, end)
            if body.startswith(self.tag, at):
                at += len(self.tag)
        return tuple(named_calls), body[at:]


class Pythonic(_Leading):
    """A Python list of calls with literal keyword arguments."""

    tag = "<|python_start|>"
    opens = "["
    END = "<|python_end|>"

    #: A list whose first element is a call cut short (or its name).
    _BEGUN = re.compile(r"\s*\[\s*(?:[A-Za-z_]\w*(?:\s*\(.*)?)?", re.DOTALL)

    def begun(self, body: str) -> bool:
        return self._BEGUN.fullmatch(body) is not None

    def calls(self, body: str, *, cut: bool) -> tuple[tuple[Call, ...], str]:
        end = body.find(self.END)
        source, rest = (body[:end], body[end + len(self.END):]) if end >= 0 else (body, "")
        calls = _python_calls(source)
        if calls is None and cut:
            # Cut short: the complete calls before the cut, the list closed after them (tried
            # at the last few ends of a call).
            ends = [m.start() + 1 for m in re.finditer(r"\)\s*,", source)][-_CUT_TRIES:]
            for close in reversed(ends):
                calls = _python_calls(source[:close] + "]")
                if calls is not None:
                    break
        return (calls or ()), rest


#: How many places a pythonic list cut by max_tokens is tried closed at.
_CUT_TRIES = 8


def _python_calls(source: str) -> tuple[Call, ...] | None:
    """The calls of ``source``, a Python list of ``name(keyword=literal, ...)`` whose arguments
    JSON can hold; None when it is not one."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls: list[Call] = []
    for node in tree.elts:
        if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
                or any(k.arg is None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            json.dumps(arguments, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a JSON literal
            return None
        calls.append((node.func.id, arguments))
    return tuple(calls)


#: The formats, by the name ``--tool-call-parser`` takes.
FORMATS: dict[str, ToolFormat] = {
    "hermes": Hermes(), "llama3": Llama3Json(), "mistral": Mistral(), "pythonic": Pythonic()}
#: Other servers' names for the same formats (SGLang's, vLLM's).
ALIASES = {"qwen25": "hermes", "llama3_json": "llama3"}
#: Every name ``--tool-call-parser`` takes.
TOOL_CALL_PARSERS = (*FORMATS, *ALIASES)


def canonical(name: str) -> str:
    """The format ``name`` (a format's name or an alias) reads."""
    return ALIASES.get(name, name)
