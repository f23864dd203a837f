"""Tool calls on ``/v1/chat/completions``: the plan a request's tools and tool_choice make, the
calls read back from an answer (forced JSON, the model's format), a stream's held-back content, and
SmolLM2 answering forced and parsed calls through the official client, plain and streamed."""

from __future__ import annotations

import json
from typing import Any

import attrs
import jsonschema
import openai
import pytest

from lifecycle import GrammarKind, GrammarSpec
from scheduler.sample.grammar import check
from scheduler.service.config import ServeConfig
from scheduler.service.openai_schema import ChatCompletionRequest, ToolCall
from scheduler.service.openai_tools import (
    ReadAnswer,
    ToolAnswer,
    ToolChoiceError,
    ToolStream,
    plan,
    read,
    template_message,
)
from tests.service_harness import run, running_service
from tests.test_openai_api import chat_config, openai_client  # noqa: F401  # the fixture

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
        "required": ["tz"], "additionalProperties": False}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "a city's weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


# -- the plan -----------------------------------------------------------------------------------


def test_each_tool_choice_plans_its_reading_and_grammar() -> None:
    assert plan(body(), None).answer is None  # no tools: text
    none = plan(body(tools=TOOLS, tool_choice="none"), None)
    assert none.answer is None and none.schema is None
    assert [t["function"]["name"] for t in none.tools] == ["get_weather", "get_time"]
    named = plan(body(tools=TOOLS, tool_choice={"type": "function",
                                                "function": {"name": "get_time"}}), None)
    assert named.answer == ToolAnswer("named", name="get_time")
    # Compact JSON unless the parameters say otherwise: flexible whitespace let a small model
    # pad a call with newlines until max_tokens.
    compact = {"x-guidance": {"whitespace_flexible": False}}
    assert named.schema is not None and json.loads(named.schema) == {**compact, **TIME}
    bare = plan(body(tools=[{"type": "function", "function": {"name": "now"}}],
                     tool_choice={"type": "function", "function": {"name": "now"}}), None)
    jsonschema.validate({}, json.loads(bare.schema or ""))  # no parameters: no arguments
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"when": 1}, json.loads(bare.schema or ""))
    required = plan(body(tools=TOOLS, tool_choice="required"), None)
    assert required.answer == ToolAnswer("required") and required.schema is not None
    schema = json.loads(required.schema)
    jsonschema.validate([{"name": "get_time", "parameters": {"tz": "UTC"}},
                         {"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for wrong in ([], [{"name": "get_time", "parameters": {"city": "Oslo"}}],
                  [{"name": "get_date", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert schema["x-guidance"] == compact["x-guidance"]
    single = json.loads(plan(body(tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False), None).schema or "")
    assert single["maxItems"] == 1
    assert plan(body(tools=TOOLS), "hermes").answer == ToolAnswer("auto", parser="hermes")
    assert not plan(body(tools=TOOLS), "hermes").keep_special_tokens
    llama = plan(body(tools=TOOLS), "llama3_json")  # vLLM's name; its tag is a special token
    assert (llama.answer, llama.keep_special_tokens) == (ToolAnswer("auto", parser="llama3"),
                                                         True)


def test_required_calls_keep_each_tools_definitions_reachable() -> None:
    """pydantic writes a nested model as ``$defs`` and ``$ref``: inside the array of calls the
    references pointed at nothing ("Pointer '/$defs/Traveler' does not exist")."""
    trip = {"type": "object", "properties": {
        "travelers": {"type": "array", "items": {"$ref": "#/$defs/Traveler"}}},
        "required": ["travelers"],
        "$defs": {"Traveler": {"type": "object", "properties": {
            "name": {"type": "string"}, "seat": {"$ref": "#/$defs/Seat/properties/row"}},
            "required": ["name"]},
            "Seat": {"type": "object", "properties": {"row": {"type": "integer"}}}}}
    old = {"type": "object", "properties": {"x": {"$ref": "#/definitions/X"},
                                            "next": {"$ref": "#"}},  # recursive
           "definitions": {"X": {"type": "boolean"}}}
    tools = [{"type": "function", "function": {"name": "book", "parameters": trip}},
             {"type": "function", "function": {"name": "flag", "parameters": old}}]
    got = plan(body(tools=tools, tool_choice="required"), None)
    schema = json.loads(got.schema or "")
    assert set(schema["$defs"]) == {"book", "flag"}
    jsonschema.validate([{"name": "book", "parameters": {"travelers": [
        {"name": "Ann", "seat": 3}]}},
        {"name": "flag", "parameters": {"x": True, "next": {"x": False}}}], schema)
    for wrong in ([{"name": "book", "parameters": {"travelers": [{"seat": 3}]}}],
                  [{"name": "book", "parameters": {"travelers": [{"name": "A", "seat": "3"}]}}],
                  [{"name": "flag", "parameters": {"x": 1}}],
                  [{"name": "flag", "parameters": {"next": {"x": 1}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    check(GrammarSpec(GrammarKind.JSON_SCHEMA, got.schema or ""))  # llguidance takes it
    assert trip["$defs"]  # the request's own schema is left as it was


def test_required_calls_leave_a_resources_references_and_data_as_they_are() -> None:
    """Inside a schema with an ``$id`` references resolve against that schema wherever it
    moves; a ``$ref`` key in ``const``/``enum``/``default`` is data, not a reference."""
    weather = {"$id": "https://example.com/weather", "type": "object",
               "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
               "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}}
    tag = {"type": "object", "properties": {"t": {"const": {"$ref": "#/x"}}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": weather}},
             {"type": "function", "function": {"name": "tag", "parameters": tag}}]
    got = plan(body(tools=tools, tool_choice="required"), None)
    schema = json.loads(got.schema or "")
    assert schema["$defs"]["weather"] == weather
    assert schema["$defs"]["tag"]["properties"]["t"] == {"const": {"$ref": "#/x"}}
    check(GrammarSpec(GrammarKind.JSON_SCHEMA, got.schema or ""))  # llguidance takes it
    jsonschema.validate([{"name": "weather", "parameters": {"loc": {"city": "Paris"}}},
                         {"name": "tag", "parameters": {"t": {"$ref": "#/x"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "parameters": {"loc": {}}}], schema)


@pytest.mark.parametrize(("fields", "reason", "param", "says"), [
    ({"tool_choice": "required"}, "invalid_request", "tool_choice", "needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "invalid_request", "tools", "'get_weather' more than once"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
     "invalid_request", "tool_choice", "'get_date', which is not one of the tools"),
    ({"tools": TOOLS}, "unsupported", "tool_choice",
     "--tool-call-parser, one of hermes, llama3, mistral, pythonic"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "bad_grammar", "tool_choice", "drop response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "bad_grammar", "tool_choice",
     "drop regex"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "bad_grammar",
     "tool_choice", "drop guided_choice"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(
        fields: dict[str, Any], reason: str, param: str, says: str) -> None:
    with pytest.raises(ToolChoiceError, match=says) as refused:
        plan(body(**fields), None)
    assert (refused.value.reason, refused.value.param) == (reason, param)


def test_messages_give_the_template_their_calls_as_objects() -> None:
    call = ToolCall.model_validate({"id": "c1", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}})
    assert template_message("assistant", "", None, [call], None) == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    raw = ToolCall.model_validate({"id": "c2", "function": {"name": "f", "arguments": "oops"}})
    assert template_message("assistant", "", None, [raw], None)["tool_calls"][0][
        "function"]["arguments"] == "oops"
    assert template_message("tool", "22 C", None, None, "c1") == {
        "role": "tool", "content": "22 C", "tool_call_id": "c1"}


# -- reading the answer -------------------------------------------------------------------------


def test_a_forced_answer_reads_as_calls_and_one_cut_short_as_content() -> None:
    named = read(ToolAnswer("named", name="get_weather"), '{"city": "Paris"}', "stop")
    assert (named.content, named.finish_reason) == (None, "stop")
    (call,) = named.calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_") and call.type == "function"
    both = read(ToolAnswer("required"), '[{"name": "get_time", "parameters": {"tz": "UTC"}}, '
                '{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "stop")
    assert both.finish_reason == "tool_calls" and both.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in both.calls] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in both.calls}) == 2
    cut = read(ToolAnswer("required"), '[{"name": "get_ti', "length")
    assert (cut.content, cut.calls, cut.finish_reason) == ('[{"name": "get_ti', (), "length")
    # A small model repeating calls until max_tokens: the complete ones stand, cut says so.
    repeated = read(ToolAnswer("required"), '[{"name":"get_time","parameters":{"tz":"UTC"}},'
                    ' {"name":"get_time","parameters":{"tz":"CET"}},{"name":"get_ti', "length")
    assert [c.function.arguments for c in repeated.calls] == ['{"tz":"UTC"}', '{"tz":"CET"}']
    assert (repeated.content, repeated.finish_reason) == (None, "length")
    # Arguments as the model wrote them (compact), not written again.
    assert read(ToolAnswer("named", name="f"), ' {"a":[1,2]}', "stop").calls[
        0].function.arguments == '{"a":[1,2]}'
    shape = read(ToolAnswer("required"), '[{"name": "f", "oops": 1}]', "stop")
    assert (shape.calls, shape.content) == ((), '[{"name": "f", "oops": 1}]')


def test_hermes_blocks_are_calls_and_the_text_around_them_content() -> None:
    auto = ToolAnswer("auto", parser="hermes")
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}')
    got = read(auto, text, "stop")  # the last block unclosed: the answer ended at EOS
    assert got.finish_reason == "tool_calls" and got.content == "Let me look.\n\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    plain = read(auto, "Paris is sunny.", "stop")
    assert (plain.content, plain.calls, plain.finish_reason) == ("Paris is sunny.", (), "stop")
    broken = "<tool_call>{not json}</tool_call> then text"
    assert read(auto, broken, "length") == ReadAnswer(broken, (), "length")  # not a call
    only = read(auto, '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>\n', "stop")
    assert only.content is None and json.loads(only.calls[0].function.arguments) == {"x": 1}
    # A closing tag cut short by max_tokens ends the block as no tag does; the answer says it
    # was cut.
    for cut in ("</tool_cal", "</", "<"):
        got = read(auto, '<tool_call>{"name": "f", "arguments": {}}' + cut, "length")
        assert [c.function.name for c in got.calls] == ["f"], cut
        assert (got.content, got.finish_reason) == (None, "length")
    # A block (or its tag) begun when max_tokens cut the answer is the lost call, not content.
    for cut in ('<tool_call>\n{"name": "', "<tool_", "<"):
        got = read(auto, "Sure. " + cut, "length")
        assert (got.content, got.calls, got.finish_reason) == ("Sure. ", (), "length"), cut
    assert read(auto, "a < b", "stop").content == "a < b"  # not cut: all of it is content
    # Arguments are JSON text whatever the block held.
    for arguments, want in (('"x"', '"x"'), ('"{\\"a\\": 1}"', '{"a": 1}'),
                            ('{"a": [1, 2]}', '{"a":[1,2]}')):
        got = read(auto, '<tool_call>{"name": "f", "arguments": ' + arguments + "}", "stop")
        assert got.calls[0].function.arguments == want, arguments


def test_a_stream_holds_back_what_may_open_a_block() -> None:
    stream = ToolStream(ToolAnswer("auto", parser="hermes"))
    sent = [stream.more(d) for d in ("Let me", " look <b>", "ok</b> <tool", "_call>{\"na")]
    assert sent == ["Let me", " look <b>", "ok</b> ", ""]
    assert stream.more('me": "f"}</tool_call> after') == ""
    text = 'Let me look <b>ok</b> <tool_call>{"name": "f"}</tool_call> after'
    rest, answer = stream.end(text, "stop")
    assert rest == " after" and answer.content == "Let me look <b>ok</b>  after"
    assert [c.function.name for c in answer.calls] == ["f"]
    cut = ToolStream(ToolAnswer("auto", parser="hermes"))
    assert cut.more('Sure. <tool_call>{"na') == "Sure. "
    assert cut.end('Sure. <tool_call>{"na', "length") == ("", ReadAnswer("Sure. ", (), "length"))
    forced = ToolStream(ToolAnswer("named", name="f"))
    assert forced.more('{"x": 1}') == ""
    rest, answer = forced.end('{"x": 1}', "stop")
    assert rest == "" and answer.calls[0].function.arguments == '{"x": 1}'


# -- SmolLM2 through the official client --------------------------------------------------------


def test_smollm2_calls_a_forced_function_plain_and_streamed(
        chat_config: ServeConfig) -> None:  # noqa: F811  # the imported fixture
    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                r = await client.chat.completions.create(
                    model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
                choice = r.choices[0]
                assert choice.finish_reason == "stop" and choice.message.content is None
                (call,) = choice.message.tool_calls or []
                assert call.function.name == "get_weather"  # type: ignore[union-attr]
                arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
                jsonschema.validate(arguments, WEATHER)
                r = await client.chat.completions.create(
                    model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                    temperature=0, max_tokens=60)
                choice = r.choices[0]
                assert choice.finish_reason == "tool_calls", choice
                calls = choice.message.tool_calls or []
                assert calls and all(c.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
                                     for c in calls)
                # Streamed: the role, then the calls in one chunk, then the finish.
                pieces: list[Any] = []
                finish = None
                async for chunk in await client.chat.completions.create(
                        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                        temperature=0, max_tokens=60, stream=True):
                    delta = chunk.choices[0].delta
                    assert not delta.content
                    pieces.extend(delta.tool_calls or [])
                    finish = chunk.choices[0].finish_reason or finish
                assert finish == "tool_calls"
                assert [(p.function.name, p.function.arguments) for p in pieces] == [
                    (c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]
                # A parameters schema that does not compile is the tools' fault.
                bad: Any = [{"type": "function", "function": {
                    "name": "f", "parameters": {"type": "thing"}}}]
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="smollm2", messages=ASK, tools=bad, tool_choice="required")
                error = refused.value.body
                assert (error["code"], error["param"]) == ("bad_grammar", "tools"), error
                assert error["message"].startswith("tools does not compile"), error
                # The calls and their results go back to the template.
                history: Any = [*ASK, {"role": "assistant", "content": None,
                                       "tool_calls": [c.model_dump() for c in calls]},
                                *({"role": "tool", "tool_call_id": c.id, "content": "22 C"}
                                  for c in calls)]
                r = await client.chat.completions.create(
                    model="smollm2", messages=history, tools=TOOLS, tool_choice="none",
                    temperature=0, max_tokens=8)
                assert r.choices[0].message.content and not r.choices[0].message.tool_calls

    run(main())


@pytest.mark.parametrize(("parser", "block"), [
    # vLLM's name of the Llama 3 format, whose tag is a special token: the answer is read with
    # special tokens, EOS still trimmed (every format's reading: tests/test_tool_formats.py).
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
])
def test_smollm2_auto_reads_the_models_format_plain_and_streamed(
        chat_config: ServeConfig, parser: str, block: str) -> None:  # noqa: F811  # the fixture
    """The model's own format under tool_choice auto; a regex makes SmolLM2 (whose template
    shows no tools) write one, so the parser's path runs end to end."""
    block = "Let me check.\n" + block
    regex = "".join("\\" + c if c in '.{}[]()|"\\' else c for c in block).replace("\n", "\\n")
    config = attrs.evolve(chat_config, tool_call_parser=parser)

    async def main() -> None:
        with running_service(config) as service:
            async with openai_client(service) as client:
                asked: Any = {"model": "smollm2", "messages": ASK, "tools": TOOLS,
                              "temperature": 0, "max_tokens": 60, "extra_body": {"regex": regex}}
                r = await client.chat.completions.create(**asked)
                message = r.choices[0].message
                assert r.choices[0].finish_reason == "tool_calls"
                assert message.content == "Let me check.\n"
                (call,) = message.tool_calls or []
                assert (call.function.name, json.loads(call.function.arguments)) == (  # type: ignore[union-attr]
                    "get_weather", {"city": "Paris"})
                content, calls, finish = "", [], None
                async for chunk in await client.chat.completions.create(**asked, stream=True):
                    delta = chunk.choices[0].delta
                    assert "<" not in (delta.content or ""), delta  # the block never leaks
                    content += delta.content or ""
                    calls.extend(delta.tool_calls or [])
                    finish = chunk.choices[0].finish_reason or finish
                assert (content, finish) == ("Let me check.\n", "tool_calls")
                assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
                # Without a block the answer is text, as without tools.
                plain = await client.chat.completions.create(**{**asked, "extra_body": {}},
                                                             max_completion_tokens=6)
                assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls

    run(main())


def test_smollm2_auto_stream_chunks_carry_the_logprobs_of_the_text_they_send(
        chat_config: ServeConfig) -> None:  # noqa: F811  # the fixture
    """A tool stream holds back text that may begin a call (`` <`` before ``<tool_call>``):
    each chunk's logprobs are those of the tokens whose text the client has been sent, so
    their text never runs ahead of the content; the rest come with the last chunk."""
    block = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
            "</tool_call>"
    regex = "".join("\\" + c if c in '.{}[]()|"\\' else c for c in block).replace("\n", "\\n")
    config = attrs.evolve(chat_config, tool_call_parser="hermes")

    async def main() -> None:
        with running_service(config) as service:
            async with openai_client(service) as client:
                asked: Any = {"model": "smollm2", "messages": ASK, "tools": TOOLS,
                              "temperature": 0, "max_tokens": 60, "logprobs": True,
                              "extra_body": {"regex": regex}}
                whole = await client.chat.completions.create(**asked)
                every = [e.token for e in whole.choices[0].logprobs.content]  # type: ignore[union-attr]
                content, tokens = "", []
                async for chunk in await client.chat.completions.create(**asked, stream=True):
                    choice = chunk.choices[0]
                    content += choice.delta.content or ""
                    tokens += [e.token for e in (choice.logprobs.content or [])
                               ] if choice.logprobs is not None else []
                    if choice.finish_reason is None:
                        assert content.startswith("".join(tokens)), (content, tokens)
                assert content == "Sure. " and whole.choices[0].message.content == "Sure. "
                assert tokens == every

    run(main())
