"""The sampling fields of ``/generate``: what reaches :class:`~lifecycle.SamplingParams`, and the
400s of what pdlife cannot honour or that is out of range."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import jsonschema
import pytest

from lifecycle import GrammarKind, GrammarSpec, SamplingParams
from scheduler.messages import TokenLogprob
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.answers import (
    LOGPROB_KEYS,
    answer_text,
    final_body,
    final_text,
    finish_reason,
)
from scheduler.service.config import Answer, AnswerOptions, BadRequest, Item, ServeConfig
from scheduler.service.core import Service
from scheduler.service.openai_format import StreamText
from scheduler.service.sampling import NEUTRAL, sampling_params_from
from scheduler.service.schema import GenerateAnswer, GenerateRequest, SamplingParamsBody
from tests.service_harness import asgi_client, run, running_service, tokens_of_stream


def mapped(**fields: Any) -> SamplingParams:
    logprobs = {k: fields.pop(k) for k in ("return_logprob", "top_logprobs_num",
                                           "logprob_start_len") if k in fields}
    # Unvalidated: these checks must hold without the published schema's (the OpenAI routes
    # build bodies of their own).
    return sampling_params_from(SamplingParamsBody.model_construct(**fields), **logprobs,
                                max_new_tokens_limit=64)


def refused(**fields: Any) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        mapped(**fields)
    assert caught.value.status == 400
    return caught.value


def test_every_field_reaches_sampling_params() -> None:
    got = mapped(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                 sampling_seed=2**64 - 1, stop=["\n\n", "END"], stop_token_ids=[3, 4],
                 ignore_eos=True, regex="[a-z]+", return_logprob=True, top_logprobs_num=20,
                 logprob_start_len=0)
    assert got == SamplingParams(
        9, (3, 4), True, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**64 - 1,
        stop=("\n\n", "END"),  # type: ignore[arg-type]  # attrs: tuple converter
        return_logprob=True, top_logprobs_num=20, logprob_start_len=0,
        grammar=GrammarSpec(GrammarKind.REGEX, "[a-z]+"))


def test_defaults_are_greedy_with_no_limits() -> None:
    got = mapped()
    assert got == SamplingParams(16)
    assert got.greedy and got.plain


def test_sglang_spellings_map_to_pdlife_values() -> None:
    assert mapped(top_k=-1).top_k == 0  # SGLang's "no limit"
    assert mapped(stop="###").stop == ("###",)
    assert mapped(json_schema='{"type": "object"}').grammar == GrammarSpec(
        GrammarKind.JSON_SCHEMA, '{"type": "object"}')
    assert mapped(ebnf='start: "a"+').grammar == GrammarSpec(GrammarKind.EBNF, 'start: "a"+')
    # Neutral values of the fields pdlife cannot honour are accepted, and the penalties'.
    assert mapped(**NEUTRAL, n=1, frequency_penalty=0.0, presence_penalty=0.0,
                  repetition_penalty=1.0, min_new_tokens=0, logit_bias={}) == SamplingParams(16)


def test_the_penalties_min_new_tokens_and_logit_bias_reach_sampling_params() -> None:
    got = mapped(max_new_tokens=8, frequency_penalty=0.5, presence_penalty=-1.0,
                 repetition_penalty=1.3, min_new_tokens=4, logit_bias={"7": 2.5, "3": -100})
    assert got == SamplingParams(8, frequency_penalty=0.5, presence_penalty=-1.0,
                                 repetition_penalty=1.3, min_new_tokens=4,
                                 logit_bias={3: -100.0, 7: 2.5})
    assert not got.plain and got.penalized and got.adjusts_logits


@pytest.mark.parametrize(("fields", "says"), [
    ({"structural_tag": "{}"}, "sampling_params.structural_tag"),
    ({"custom_params": {"x": 1}}, "sampling_params.custom_params"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
])
def test_fields_pdlife_cannot_honour_are_refused_by_name(fields: dict[str, Any],
                                                         says: str) -> None:
    exc = refused(**fields)
    assert exc.reason == "unsupported"
    assert says in str(exc)


@pytest.mark.parametrize(("fields", "reason", "says"), [
    ({"temperature": -0.5}, "bad_sampling", "temperature must be in [0.0, 100.0], got -0.5"),
    ({"top_p": 0.0}, "bad_sampling", "top_p must be in (0.0, 1.0], got 0.0"),
    ({"top_p": 1.5}, "bad_sampling", "top_p must be in (0.0, 1.0]"),
    ({"top_k": 0}, "bad_sampling", "top_k must be -1 (no limit) or 1..2147483648, got 0"),
    ({"top_k": -2}, "bad_sampling", "top_k must be -1 (no limit) or 1..2147483648, got -2"),
    ({"min_p": 1.5}, "bad_sampling", "min_p must be in [0.0, 1.0]"),
    ({"top_logprobs_num": 21}, "bad_sampling", "top_logprobs_num must be in [0, 20], got 21"),
    ({"logprob_start_len": -2}, "bad_sampling", "logprob_start_len must be -1"),
    ({"stop": ["ok", ""]}, "bad_sampling", "a stop string must not be empty"),
    ({"max_new_tokens": 65}, "bad_max_new_tokens", "max_new_tokens must be at most 64, got 65"),
    ({"json_schema": "{not json"}, "bad_grammar", "json_schema is not valid JSON"),
    # An integer beyond Python's 4,300 digits: json.loads raises a ValueError of its own.
    ({"json_schema": '{"maximum": ' + "9" * 5000 + "}"}, "bad_grammar",
     "json_schema is not valid JSON: Exceeds the limit (4300 digits)"),
    ({"json_schema": "[1, 2]"}, "bad_grammar", "must be a JSON schema (an object or a boolean)"),
    ({"json_schema": '{"type": "nonsense"}'}, "bad_grammar",
     "sampling_params.json_schema does not compile"),
    ({"regex": "("}, "bad_grammar", "sampling_params.regex does not compile"),
    ({"ebnf": "start: ("}, "bad_grammar", "sampling_params.ebnf does not compile"),
    ({"json_schema": "{}", "regex": "a"}, "bad_grammar",
     "sampling_params.regex: give at most one grammar field, got sampling_params.json_schema "
     "and sampling_params.regex"),
    ({"regex": "(abc"}, "bad_grammar", "sampling_params.regex does not compile: at "),
    ({"frequency_penalty": 2.5}, "bad_sampling", "frequency_penalty must be in [-2.0, 2.0]"),
    ({"presence_penalty": -3}, "bad_sampling", "presence_penalty must be in [-2.0, 2.0]"),
    ({"repetition_penalty": 0}, "bad_sampling", "repetition_penalty must be in (0.0, 2.0]"),
    ({"min_new_tokens": 17}, "bad_sampling",
     "sampling_params.min_new_tokens must be at most sampling_params.max_new_tokens (16), got 17"),
    ({"logit_bias": {"x": 1.0}}, "bad_sampling", "keys are token ids in decimal, got 'x'"),
    ({"logit_bias": {"-1": 1.0}}, "bad_sampling", "keys are token ids in decimal, got '-1'"),
    ({"logit_bias": {"5_0": 1.0}}, "bad_sampling", "keys are token ids in decimal, got '5_0'"),
    ({"logit_bias": {"05": 1.0}}, "bad_sampling", "keys are token ids in decimal, got '05'"),
    ({"logit_bias": {" 5": 1.0}}, "bad_sampling", "keys are token ids in decimal, got ' 5'"),
    ({"logit_bias": {"1": float("nan")}}, "bad_sampling", "must be finite"),
])
def test_out_of_range_values_are_refused_with_the_field_and_range(
        fields: dict[str, Any], reason: str, says: str) -> None:
    exc = refused(**fields)
    assert exc.reason == reason
    assert says in str(exc)
    assert str(exc).count("does not compile") <= 1


# -- through /generate ------------------------------------------------------------------------

MODEL = ModelConfig.tiny(seed=3)
CONFIG = ServeConfig(role="both", backend="local", model=MODEL,
                     scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16),
                     pool_pages=64, metadata_slots=8, max_new_tokens_limit=32)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with running_service(CONFIG) as s:
        yield s


def post(service: Service, *bodies: dict[str, Any]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        async with asgi_client(service) as client:
            return [await client.post("/generate", json=b) for b in bodies]
    answers: list[httpx.Response] = run(main())
    return answers


HTTP_REFUSALS: list[tuple[dict[str, Any], str, str]] = [
    ({"temperature": -1}, "invalid_request", "sampling_params.temperature"),
    ({"top_p": 0}, "invalid_request", "sampling_params.top_p"),
    ({"top_p": 1.5}, "invalid_request", "sampling_params.top_p"),
    ({"top_k": 0}, "bad_sampling", "top_k must be -1 (no limit) or 1..2147483648"),
    ({"top_k": -2}, "invalid_request", "sampling_params.top_k"),
    ({"min_p": 2}, "invalid_request", "sampling_params.min_p"),
    ({"stop": 5}, "invalid_request", "sampling_params.stop"),
    ({"json_schema": "{"}, "bad_grammar", "json_schema is not valid JSON"),
    ({"regex": "(", "ebnf": "start: \"a\""}, "bad_grammar", "at most one grammar field"),
    ({"n": 17}, "bad_sampling", "sampling_params.n must be in 1..16, got 17"),
    ({"n": 0}, "bad_sampling", "sampling_params.n must be in 1..16, got 0"),
    ({"frequency_penalty": 2.5}, "invalid_request", "sampling_params.frequency_penalty"),
    ({"repetition_penalty": 0}, "invalid_request", "sampling_params.repetition_penalty"),
    ({"min_new_tokens": -1}, "invalid_request", "sampling_params.min_new_tokens"),
    ({"min_new_tokens": 17}, "bad_sampling", "must be at most sampling_params.max_new_tokens"),
    ({"logit_bias": {"258": 2.0}}, "bad_token_id",
     "sampling_params.logit_bias: token ids must be in 0..257, got 258"),
    ({"stop_regex": "(a"}, "bad_sampling",
     "sampling_params.stop_regex '(a' is not a regular expression: missing ), unterminated "
     "subpattern"),
    ({"stop_regex": "(?<=a+)b"}, "bad_sampling",  # the regex module alone would take it
     "sampling_params.stop_regex '(?<=a+)b' is not a regular expression: look-behind requires "
     "fixed-width pattern"),
    ({"stop_regex": ["a+", "b*"]}, "bad_sampling",
     "sampling_params.stop_regex 'b*' matches the empty string (it would match at once)"),
]
TOP_REFUSALS: list[tuple[dict[str, Any], str, str]] = [
    ({"top_logprobs_num": 21}, "invalid_request", "top_logprobs_num"),
    ({"logprob_start_len": -2}, "invalid_request", "logprob_start_len"),
    ({"token_ids_logprob": [1, 2]}, "bad_sampling", "token_ids_logprob needs return_logprob"),
    ({"token_ids_logprob": [1, 300], "return_logprob": True}, "bad_token_id",
     "token_ids_logprob: token ids must be in 0..257, got 300"),
    ({"token_ids_logprob": list(range(65)), "return_logprob": True}, "bad_sampling",
     "token_ids_logprob: at most 64 token ids per prompt, got 65"),
    ({"token_ids_logprob": [[1], [2]], "return_logprob": True}, "bad_batch",
     "token_ids_logprob: a list of lists is a batch's, one per prompt; for one prompt give a "
     "list of token ids"),
    ({"token_ids_logprob": [-1], "return_logprob": True}, "invalid_request",
     "token_ids_logprob"),
    ({"return_hidden_states": True}, "unsupported", "return_hidden_states"),
    ({"image_data": "http://x/y.png"}, "unsupported", "image_data"),
    ({"lora_path": "adapter"}, "unsupported", "lora_path"),
]


@pytest.mark.parametrize(("sampling", "reason", "says"), HTTP_REFUSALS,
                         ids=[f"{next(iter(s))}-{r}" for s, r, _ in HTTP_REFUSALS])
def test_generate_refuses_sampling_fields_with_400_naming_them(
        service: Service, sampling: dict[str, Any], reason: str, says: str) -> None:
    (r,) = post(service, {"text": "hi", "sampling_params": sampling})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == reason
    assert says in r.json()["error"]["message"]


@pytest.mark.parametrize(("fields", "reason", "says"), TOP_REFUSALS,
                         ids=[f"{next(iter(s))}-{r}" for s, r, _ in TOP_REFUSALS])
def test_generate_refuses_top_level_fields_it_cannot_honour(
        service: Service, fields: dict[str, Any], reason: str, says: str) -> None:
    (r,) = post(service, {"text": "hi", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == reason
    assert says in r.json()["error"]["message"]


def test_unknown_fields_are_ignored_and_neutral_values_accepted(service: Service) -> None:
    plain, extra = post(
        service,
        {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
        {"input_ids": [5, 6, 7], "router_added": {"x": 1}, "return_hidden_states": False,
         "sampling_params": {"max_new_tokens": 4, "some_future_field": True, "n": 1,
                             "frequency_penalty": 0, "presence_penalty": 0.0,
                             "repetition_penalty": 1, "min_new_tokens": 0, "logit_bias": {},
                             "top_k": -1, "temperature": 0, "skip_special_tokens": True}},
    )
    assert plain.status_code == extra.status_code == 200, (plain.text, extra.text)
    assert plain.json()["output_ids"] == extra.json()["output_ids"]
    assert "input_token_logprobs" not in plain.json()["meta_info"]


# -- answers ----------------------------------------------------------------------------------

BYTES = ByteTokenizer()


def item(options: AnswerOptions | None = None, **sampling: Any) -> Item:
    return Item("r", (1, 2, 3), SamplingParams(8, **sampling), "2.2.2.2", 0, 1,
                options or AnswerOptions())


def done(ids: Sequence[int], finish: str = "stop", matched: int | str | None = None,
         **kw: Any) -> Answer:
    return Answer(rid="r", status=200, output_ids=tuple(ids), finish_reason=finish, message="",
                  reason=None, prompt_tokens=3, e2e_latency=0.1, matched_stop=matched, **kw)


def test_a_matched_stop_is_cut_from_the_text_unless_no_stop_trim() -> None:
    ids = BYTES.encode("one. two. three")
    keep = AnswerOptions(no_stop_trim=True)
    # At the string's first occurrence.
    assert answer_text(BYTES, item(stop=". t"), ids, ". t") == "one"
    assert answer_text(BYTES, item(keep, stop=". t"), ids, ". t") == "one. two. three"
    # At the first match of a regex, the one a stream of the same text was cut at.
    for pattern, cut in ((r"\. t\w", "one"), (r"t[hw]+", "one. "), (r"o+\.", "one. tw")):
        regex = item(stop_regex=pattern)
        assert answer_text(BYTES, regex, ids, pattern) == cut
        assert answer_text(BYTES, item(keep, stop_regex=pattern), ids, pattern) == BYTES.decode(ids)
        stream = StreamText(BYTES, regex)
        sent = "".join(stream.more([t]) for t in ids)
        assert sent == cut, (pattern, sent)
    assert answer_text(BYTES, item(), ids, ord("e")) == "one. two. thre"  # a stop token
    assert answer_text(BYTES, item(keep), ids, ord("e")) == "one. two. three"
    assert answer_text(BYTES, item(), ids, None) == "one. two. three"
    # A completed grammar's last token matched no stop: the text keeps it.
    assert final_text(BYTES, item(), done(ids)) == "one. two. three"
    assert final_text(BYTES, item(), done(ids, matched=ord("e"))) == "one. two. thre"
    assert final_text(BYTES, item(), done(ids, "length", matched=ord("e"))) == "one. two. three"


def test_finish_reason_stop_names_what_matched() -> None:
    assert finish_reason(done([65, 66], matched="B")).model_dump(exclude_none=True) == {
        "type": "stop", "matched": "B"}
    assert finish_reason(done([65, 257])).matched == 257  # EOS (or a completed grammar)
    assert finish_reason(done([65, 66], "length")).model_dump(exclude_none=True) == {
        "type": "length", "length": 2}


def test_logprob_fields_have_sglang_shapes() -> None:
    inputs = (TokenLogprob(1, None), TokenLogprob(2, -0.5, ((2, -0.5), (9, -1.5))),
              TokenLogprob(3, -2.0, ((7, -0.1),)))
    outputs = (TokenLogprob(65, -0.25, ((65, -0.25), (66, -3.0))),
               TokenLogprob(66, -1.0, ((67, -0.5), (66, -1.0))))
    asked = item(return_logprob=True, top_logprobs_num=2)
    body = final_body(BYTES, asked, done([65, 66], "length", input_logprobs=inputs,
                                         output_logprobs=outputs))
    meta = body["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None], [-2.0, 3, None]]
    assert meta["output_token_logprobs"] == [[-0.25, 65, None], [-1.0, 66, None]]
    assert meta["input_top_logprobs"] == [None, [[-0.5, 2, None], [-1.5, 9, None]],
                                          [[-0.1, 7, None]]]
    assert meta["output_top_logprobs"] == [[[-0.25, 65, None], [-3.0, 66, None]],
                                           [[-0.5, 67, None], [-1.0, 66, None]]]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    GenerateAnswer.model_validate(body)  # the published schema holds it
    # Token text only when asked; top lists only with top_logprobs_num > 0.
    text = item(AnswerOptions(return_text_in_logprobs=True), return_logprob=True)
    meta = final_body(BYTES, text, done([65], "length", output_logprobs=outputs[:1]))[
        "meta_info"]
    assert meta["output_token_logprobs"] == [[-0.25, 65, "A"]]
    assert meta["input_token_logprobs"] == []
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta
    # Nothing of it without return_logprob.
    meta = final_body(BYTES, item(), done([65], "length", output_logprobs=outputs[:1]))[
        "meta_info"]
    assert not set(LOGPROB_KEYS) & set(meta)


# -- end to end (the reference model, colocated) ----------------------------------------------

PROMPT = [72, 101, 108, 108, 111]


def generate(service: Service, **body: Any) -> dict[str, Any]:
    (r,) = post(service, {"input_ids": PROMPT, **body})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_a_seeded_draw_repeats_and_differs_from_greedy(service: Service) -> None:
    fixed = {"max_new_tokens": 10, "ignore_eos": True}
    greedy = generate(service, sampling_params=fixed)["output_ids"]
    drawn = {**fixed, "temperature": 1.0, "sampling_seed": 42}
    first = generate(service, sampling_params=drawn)["output_ids"]
    assert generate(service, sampling_params=drawn)["output_ids"] == first
    assert first != greedy
    assert generate(service, sampling_params={**drawn, "sampling_seed": 43})["output_ids"] != first
    # top_k 1 is greedy whatever the temperature.
    assert generate(service, sampling_params={**drawn, "top_k": 1})["output_ids"] == greedy


def test_logprob_answers_have_sglang_shapes_and_lengths(service: Service) -> None:
    answer = generate(service, return_logprob=True, top_logprobs_num=3, logprob_start_len=0,
                      return_text_in_logprobs=True,
                      sampling_params={"max_new_tokens": 6, "ignore_eos": True})
    meta, ids = answer["meta_info"], answer["output_ids"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(ids) == 6
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == ids
    assert [tok for _, tok, _ in meta["input_token_logprobs"]] == PROMPT
    assert meta["input_token_logprobs"][0][0] is None  # nothing predicts the first token
    assert all(lp <= 0 for lp, _, _ in meta["input_token_logprobs"][1:])
    assert [text for _, _, text in meta["output_token_logprobs"]] == [
        BYTES.decode([t]) for t in ids]
    assert meta["input_top_logprobs"][0] is None
    for top, (lp, tok, _) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"],
                                 strict=True):
        assert len(top) == 3
        assert top[0][:2] == [lp, tok]  # greedy: the chosen token is the most likely
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
    # Without top_logprobs_num: no top lists; without logprob_start_len: no input logprobs.
    meta = generate(service, return_logprob=True,
                    sampling_params={"max_new_tokens": 2, "ignore_eos": True})["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert len(meta["output_token_logprobs"]) == 2
    assert "output_top_logprobs" not in meta


def test_named_ids_logprobs_are_given_at_every_position(service: Service) -> None:
    """``token_ids_logprob``: the named ids' logprobs at every prompt position from
    ``logprob_start_len`` and every output position, in the order named, from the same rows as
    the chosen tokens' (an id named that is the chosen token has the chosen token's value)."""
    answer = generate(service, return_logprob=True, logprob_start_len=0,
                      token_ids_logprob=[PROMPT[2], 7, PROMPT[2]],
                      sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    meta, ids = answer["meta_info"], answer["output_ids"]
    inputs, outputs = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert inputs[0] is None and len(inputs) == len(PROMPT)  # nothing predicts token 0
    assert len(outputs) == len(ids) == 5
    for entries in [*inputs[1:], *outputs]:
        assert [tok for _, tok, _ in entries] == [PROMPT[2], 7, PROMPT[2]]
        assert entries[0][0] == entries[2][0] <= 0 and entries[1][0] <= 0
    # Position 1 scores prompt token 2: the same value as its input logprob.
    assert inputs[2][0][0] == meta["input_token_logprobs"][2][0]
    for (lp, tok, _), entries in zip(meta["output_token_logprobs"], outputs, strict=True):
        if tok == 7:
            assert entries[1][0] == lp
    # A batch names ids per prompt; without them no such field.
    (r,) = post(service, {"input_ids": [PROMPT, PROMPT[:3]], "return_logprob": True,
                          "token_ids_logprob": [[3], [4, 5]],
                          "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    first, second = r.json()
    (wrong,) = post(service, {"input_ids": [PROMPT, PROMPT[:3]], "return_logprob": True,
                              "token_ids_logprob": [[3], [4], [5]]})
    assert wrong.json()["error"]["message"] == (
        "token_ids_logprob has 3 lists for a batch of 2 prompts (give one list of ids for "
        "all, or one per prompt)")
    assert [[t for _, t, _ in e] for e in first["meta_info"]["output_token_ids_logprobs"]] == [
        [3], [3]]
    assert [[t for _, t, _ in e] for e in second["meta_info"]["output_token_ids_logprobs"]] == [
        [4, 5], [4, 5]]
    assert "output_token_ids_logprobs" not in generate(
        service, return_logprob=True, sampling_params={"max_new_tokens": 2})["meta_info"]


def test_a_named_id_a_grammar_forbids_has_a_null_logprob(service: Service) -> None:
    answer = generate(service, return_logprob=True, token_ids_logprob=[ord("a"), ord("z")],
                      sampling_params={"max_new_tokens": 3, "regex": "[a-c]{3}"})
    for entries in answer["meta_info"]["output_token_ids_logprobs"]:
        (a, _, _), (z, _, _) = entries
        assert a is not None and a <= 0 and z is None


def test_one_token_answers_of_a_batch_keep_their_input_logprobs(service: Service) -> None:
    """An answer of one token can end on the decode side before the prefill side's answer
    (which brings the input logprobs) is read; it waits for them."""
    prompts = [PROMPT, PROMPT[:3], PROMPT[1:]]
    (r,) = post(service, {"input_ids": prompts, "return_logprob": True, "logprob_start_len": 0,
                          "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}})
    for prompt, answer in zip(prompts, r.json(), strict=True):
        meta = answer["meta_info"]
        assert [tok for _, tok, _ in meta["input_token_logprobs"]] == prompt
        assert len(meta["output_token_logprobs"]) == 1


def test_stop_strings_and_tokens_end_and_trim_the_answer(service: Service) -> None:
    full = generate(service, sampling_params={"max_new_tokens": 12, "ignore_eos": True})
    ids, text = full["output_ids"], full["text"]
    stop = BYTES.decode(ids[3:5])
    cut = generate(service, sampling_params={"max_new_tokens": 12, "ignore_eos": True,
                                             "stop": stop})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["output_ids"] == ids[:5]
    assert cut["text"] == text[:text.find(stop)]
    kept = generate(service, sampling_params={"max_new_tokens": 12, "ignore_eos": True,
                                              "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == BYTES.decode(ids[:5])
    token = generate(service, sampling_params={"max_new_tokens": 12, "stop_token_ids": [ids[2]]})
    assert token["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert token["output_ids"] == ids[:3]
    assert token["text"] == BYTES.decode(ids[:2])


def test_stop_regexes_end_and_trim_the_answer_as_the_same_stop_string(service: Service) -> None:
    """A regex matching what a stop string matches ends the answer at the same token; one
    without a bound on its matches too (the decode side searches the whole output); the
    finish reason names the pattern."""
    full = generate(service, sampling_params={"max_new_tokens": 12, "ignore_eos": True})
    ids, text = full["output_ids"], full["text"]
    stop = BYTES.decode(ids[3:5])
    for pattern in (re.escape(stop), f"{re.escape(stop[0])}+{re.escape(stop[1:])}"):
        cut = generate(service, sampling_params={"max_new_tokens": 12, "ignore_eos": True,
                                                 "stop_regex": ["zzz{3}", pattern]})
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
        assert cut["output_ids"] == ids[:5], pattern
        assert cut["text"] == text[:text.find(stop)]
        kept = generate(service, sampling_params={"max_new_tokens": 12, "ignore_eos": True,
                                                  "stop_regex": pattern, "no_stop_trim": True})
        assert kept["text"] == BYTES.decode(ids[:5])
    # An anchor holds at the output's start, not at the start of the tail the decode side reads.
    anchored = generate(service, sampling_params={"max_new_tokens": 12, "ignore_eos": True,
                                                  "stop_regex": f"^{re.escape(stop)}"})
    assert anchored["meta_info"]["finish_reason"]["type"] == "length", anchored
    assert anchored["text"] == text


def test_a_stop_regex_that_backtracks_catastrophically_fails_its_request_alone(
        service: Service) -> None:
    """An answer of ``a``s searched for ``(a|a)+b``: each search takes twice as long as the
    last (``re`` would hold the GIL until it ended, freezing the worker). The search stops at
    its budget and the request fails, 400 naming the pattern, while the request decoded beside
    it and /health are answered."""
    forced = {"max_new_tokens": 32, "ignore_eos": True, "logit_bias": {str(ord("a")): 100}}

    async def main() -> list[httpx.Response]:
        async with asgi_client(service) as client:
            answers: list[httpx.Response] = await asyncio.wait_for(asyncio.gather(
                client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
                    **forced, "stop_regex": ["zz", "(a|a)+b"]}}),
                client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
                    **forced, "stop_regex": ["a+b"]}}),
                client.get("/health"),
            ), timeout=60)
            return answers

    slow, beside, health = run(main())
    assert slow.status_code == 400, slow.text
    error = slow.json()["error"]
    assert error["type"] == "rejected"
    assert error["message"].startswith("stop_regex '(a|a)+b' took too long on the output: "
                                       "searching its "), error
    assert beside.status_code == 200, beside.text
    assert beside.json()["text"] == "a" * 32
    assert beside.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 32}
    assert health.status_code == 200, health.text


def test_a_stop_regex_too_slow_for_the_streamed_text_fails_the_stream_with_a_400() -> None:
    """``(a|a){1,14}b`` spans at most 15 characters, so the decode side searches the newest
    few only (milliseconds), while an OpenAI stream settles what it may send by searching the
    whole text so far (hundreds of milliseconds for 256 ``a``s): past the budget the stream
    ends with a 400 error event and [DONE], not a cut connection, and the request is
    aborted."""
    config = attrs.evolve(CONFIG, pool_pages=160, max_new_tokens_limit=256)
    body = {"prompt": PROMPT, "stream": True, "max_tokens": 256, "temperature": 0,
            "ignore_eos": True, "logit_bias": {str(ord("a")): 100},
            "stop_regex": "(a|a){1,14}b"}

    async def main(service: Service) -> str:
        async with asgi_client(service) as client:
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=120)
            assert r.status_code == 200
            return r.text

    with running_service(config) as service:
        chunks, done = tokens_of_stream(run(main(service)))
        assert service.wait_drained(30)
    assert done, "the stream was cut before [DONE]"
    error = chunks[-1]["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "rejected"), error
    assert error["message"].startswith("stop_regex '(a|a){1,14}b' took too long on the "
                                       "output: searching its "), error


def test_a_grammar_shapes_the_answer_and_keeps_its_last_token(service: Service) -> None:
    answer = generate(service, sampling_params={"max_new_tokens": 12, "regex": "[a-c]{3}x",
                                                "temperature": 0.8, "sampling_seed": 5})
    assert re.fullmatch("[a-c]{3}x", answer["text"])
    assert answer["meta_info"]["finish_reason"]["type"] == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    answer = generate(service, sampling_params={"max_new_tokens": 24,
                                                "json_schema": json.dumps(schema)})
    assert answer["meta_info"]["finish_reason"] == {"type": "stop",
                                                    "matched": answer["output_ids"][-1]}
    jsonschema.validate(json.loads(answer["text"]), schema)  # the closing brace is kept


def test_a_stream_ends_with_the_whole_answer_and_its_logprobs(service: Service) -> None:
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    (r,) = post(service, body)
    chunks, done = tokens_of_stream(r.text)
    assert done
    last = chunks[-1]
    plain = generate(service, return_logprob=True,
                     sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert last["output_ids"] == plain["output_ids"]
    assert last["meta_info"]["output_token_logprobs"] == plain["meta_info"][
        "output_token_logprobs"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_operations_md_lists_every_generate_field() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    section = docs[docs.index("`POST /generate` takes SGLang's fields"):
                   docs.index("**The seeded stream.**")]
    fields = [*GenerateRequest.model_fields, *SamplingParamsBody.model_fields]
    assert [f for f in fields if f"`{f}`" not in section] == []
