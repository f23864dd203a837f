"""The tool-call formats ``--tool-call-parser`` reads: each format's calls and content, answers
cut by ``max_tokens``, and (a property over every format) a stream never sends as content what
the whole answer reads as a call."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cli.serve import SERVE
from scheduler.service.config import ServeConfig
from scheduler.service.openai_tools import ToolAnswer, ToolStream, read
from scheduler.service.tool_formats import FORMATS, TOOL_CALL_PARSERS, canonical


def calls_of(parser: str, text: str, finish: str = "stop") -> tuple[Any, ...]:
    answer = read(ToolAnswer("auto", parser=parser), text, finish)
    return (answer.content, [(c.function.name, json.loads(c.function.arguments))
                             for c in answer.calls], answer.finish_reason)


PARIS = ("get_weather", {"city": "Paris"})
UTC = ("get_time", {"tz": "UTC"})


def test_llama3_json_objects_begin_the_answer_or_follow_the_python_tag() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls_of("llama3", one) == (None, [PARIS], "tool_calls")
    two = one + '; {"name": "get_time", "arguments": {"tz": "UTC"}}'
    assert calls_of("llama3", "\n" + two) == (None, [PARIS, UTC], "tool_calls")
    assert calls_of("llama3", "Let me check.<|python_tag|>" + one) == (
        "Let me check.", [PARIS], "tool_calls")
    # Text that is not a call stays content: prose, JSON without a name, prose after the tag.
    assert calls_of("llama3", "Paris is sunny.") == ("Paris is sunny.", [], "stop")
    assert calls_of("llama3", '{"city": "Paris"}') == ('{"city": "Paris"}', [], "stop")
    assert calls_of("llama3", "a <|python_tag|>b") == ("a <|python_tag|>b", [], "stop")
    # Cut by max_tokens: the complete calls stand, the object the cut lost is not content.
    assert calls_of("llama3", one + '; {"name": "get_ti', "length") == (None, [PARIS], "length")
    assert calls_of("llama3", 'Sure.<|python_tag|>{"na', "length") == ("Sure.", [], "length")
    assert calls_of("llama3", "Sure. <|python_", "length") == ("Sure. ", [], "length")


def test_mistral_reads_the_tagged_array_the_named_form_and_an_untagged_array() -> None:
    array = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
            '{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    assert calls_of("mistral", "[TOOL_CALLS] " + array) == (None, [PARIS, UTC], "tool_calls")
    assert calls_of("mistral", "Checking. [TOOL_CALLS]" + array) == (
        "Checking. ", [PARIS, UTC], "tool_calls")
    assert calls_of("mistral", array) == (None, [PARIS, UTC], "tool_calls")  # tag dropped
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz":"UTC"}'
    assert calls_of("mistral", named) == (None, [PARIS, UTC], "tool_calls")
    assert calls_of("mistral", "[1, 2, 3]") == ("[1, 2, 3]", [], "stop")  # a list, not calls
    assert calls_of("mistral", "[TOOL_CALLS] " + array[:70], "length") == (
        None, [PARIS], "length")
    assert calls_of("mistral", '[TOOL_CALLS]get_weather[ARGS]{"ci', "length") == (
        None, [], "length")


def test_pythonic_lists_of_calls_with_literal_arguments() -> None:
    assert calls_of("pythonic", '[get_weather(city="Paris"), get_time(tz=\'UTC\')]') == (
        None, [PARIS, UTC], "tool_calls")
    assert calls_of("pythonic", "[get_time()]")[1] == [("get_time", {})]
    assert calls_of("pythonic", "[f(n=1, xs=[1.5, None], ok=True, d={'a': (1, 2)})]")[1] == [
        ("f", {"n": 1, "xs": [1.5, None], "ok": True, "d": {"a": [1, 2]}})]
    assert calls_of("pythonic", 'Sure.<|python_start|>[get_weather(city="Paris")]'
                    "<|python_end|>") == ("Sure.", [PARIS], "tool_calls")
    # Not calls: prose, positional arguments, expressions, what JSON cannot hold.
    for text in ("Paris is sunny.", '[get_weather("Paris")]', "[f(x=1+2)]", "[f(x=os.sep)]",
                 "[f(x={1, 2})]", "[f(x=b'1')]", "[]", "[f(**kw)]", "[" * 10_000):
        assert calls_of("pythonic", text) == (text, [], "stop"), text
    cut = '[get_weather(city="Paris"), get_time(tz="UTC"), get_weather(city="Ro'
    assert calls_of("pythonic", cut, "length") == (None, [PARIS, UTC], "length")
    assert calls_of("pythonic", '[get_weather(city="Pa', "length") == (None, [], "length")


def test_every_name_the_flag_takes_reads_its_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(TOOL_CALL_PARSERS) == {"hermes", "qwen25", "llama3", "llama3_json", "mistral",
                                      "pythonic"}
    assert {canonical(name) for name in TOOL_CALL_PARSERS} == set(FORMATS)
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert calls_of(canonical("qwen25"), block)[1] == [PARIS]
    with pytest.raises(ValueError, match=r"tool_call_parser 'qwen3'.*hermes, llama3, mistral"):
        ServeConfig(role="both", backend="local", tool_call_parser="qwen3")
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    with pytest.raises(SystemExit):  # the flag says so at once, before a model loads
        parser.parse_args(["--tool-call-parser", "qwen3"])
    assert "invalid choice: 'qwen3'" in capsys.readouterr().err
    # Only the formats whose tags are special tokens read the answer with them.
    assert {n for n, f in FORMATS.items() if f.special_tags} == {"llama3", "mistral", "pythonic"}


def test_a_stream_sends_text_until_calls_may_begin() -> None:
    stream = ToolStream(ToolAnswer("auto", parser="llama3"))
    assert [stream.more(d) for d in ("  ", "{\"name\"", ": \"f\"}")] == ["", "", ""]
    assert stream.end('  {"name": "f"}', "stop")[0] == ""
    prose = ToolStream(ToolAnswer("auto", parser="pythonic"))
    assert [prose.more(d) for d in (" It", " is <|py", "thon_start|>[f()]")] == [
        " It", " is ", ""]
    rest, answer = prose.end(" It is <|python_start|>[f()]", "stop")
    assert (rest, answer.content, [c.function.name for c in answer.calls]) == (
        "", " It is ", ["f"])


# -- what a stream sends, for every format ------------------------------------------------------

_PIECES = {
    "hermes": ['<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "<tool_call>",
               "</tool_call>", "<tool", '{"name": "g"}'],
    "llama3": ['{"name": "f", "parameters": {"a": 1}}', "; ", "<|python_tag|>", "<|pyth",
               '{"a": 1}'],
    "mistral": ['[{"name": "f", "arguments": {"a": 1}}]', "[TOOL_CALLS]", "[TOOL_",
                'f[ARGS]{"a": 1}', "[1]"],
    "pythonic": ["[f(a=1)]", "[f(a=1), g()]", "<|python_start|>", "<|python_end|>", "[f(a"],
}
_WORDS = ["Sure.", " ", "\n", "a < b", "{", "[", "]", "}", "x"]


@pytest.mark.parametrize("parser", sorted(FORMATS))
@settings(max_examples=max(400, settings.default.max_examples))  # cheap: more than the profile's
@given(data=st.data())
def test_a_stream_never_sends_what_the_answer_reads_as_a_call(parser: str,
                                                              data: st.DataObject) -> None:
    pieces = data.draw(st.lists(st.sampled_from(_PIECES[parser] + _WORDS), max_size=8))
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    finish = data.draw(st.sampled_from(["stop", "length"]))
    stream = ToolStream(ToolAnswer("auto", parser=parser))
    sent = "".join(stream.more(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)],
                                                          strict=True))
    rest, answer = stream.end(text, finish)
    content = answer.content or ""
    assert content.startswith(sent), (text, sent, content)
    assert sent + rest == content
    assert answer.finish_reason in (finish, "tool_calls")


@pytest.mark.parametrize(("parser", "text"), [
    ("mistral", "[1] Paris is the capital"), ("mistral", "[Note] Paris is the capital"),
    ("pythonic", "[Note] Paris is"), ("pythonic", "[1] Paris is"),
    ("llama3", "{Paris} is the capital"), ("llama3", '{"a": 1} and more'),
])
def test_text_cut_by_max_tokens_that_only_opens_like_a_call_stays_content(parser: str,
                                                                           text: str) -> None:
    assert calls_of(parser, text, "length") == (text, [], "length")
    stream = ToolStream(ToolAnswer("auto", parser=parser))
    sent = stream.more(text)
    rest, answer = stream.end(text, "length")
    assert sent + rest == text and answer.content == text


@pytest.mark.parametrize(("parser", "text"), [
    ("mistral", '[{"name": "get_weather", "argu'), ("mistral", "["),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Pa\\u00'), ("llama3", "{"),
    ("pythonic", "[get_wea"), ("pythonic", "[get_weather(city='Pa"),
    ("hermes", '  \n<tool_call>{"name": "get_weather", "argu'),
])
def test_a_call_cut_by_max_tokens_before_it_is_complete_is_no_content(parser: str,
                                                                      text: str) -> None:
    assert calls_of(parser, text, "length") == (None, [], "length")
