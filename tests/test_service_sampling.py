"""The sampling fields of ``/generate``: what reaches :class:`~lifecycle.SamplingParams`, and the
400s of what pdlife cannot honour or that is out of range."""

from __future__ import annotations

from typing import Any

import pytest

from lifecycle import GrammarKind, GrammarSpec, SamplingParams
from scheduler.service.config import BadRequest
from scheduler.service.sampling import NEUTRAL, sampling_params_from
from scheduler.service.schema import SamplingParamsBody


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
        stop=("\n\n", "END"), return_logprob=True, top_logprobs_num=20, logprob_start_len=0,
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
    # Neutral values of the fields pdlife cannot honour are accepted.
    assert mapped(**{**NEUTRAL, "logit_bias": {}}, n=1) == SamplingParams(16)


@pytest.mark.parametrize(("fields", "says"), [
    ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty=0.5"),
    ({"presence_penalty": -1.0}, "sampling_params.presence_penalty"),
    ({"repetition_penalty": 1.1}, "sampling_params.repetition_penalty"),
    ({"min_new_tokens": 4}, "sampling_params.min_new_tokens"),
    ({"logit_bias": {"5": 10.0}}, "sampling_params.logit_bias"),
    ({"stop_regex": "a+"}, "sampling_params.stop_regex"),
    ({"structural_tag": "{}"}, "sampling_params.structural_tag"),
    ({"custom_params": {"x": 1}}, "sampling_params.custom_params"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"n": 2}, "only n=1 is supported"),
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
    ({"top_k": 0}, "bad_sampling", "top_k must be -1 (no limit) or >= 1, got 0"),
    ({"top_k": -2}, "bad_sampling", "top_k must be -1 (no limit) or >= 1, got -2"),
    ({"min_p": 1.5}, "bad_sampling", "min_p must be in [0.0, 1.0]"),
    ({"top_logprobs_num": 21}, "bad_sampling", "top_logprobs_num must be in [0, 20], got 21"),
    ({"logprob_start_len": -2}, "bad_sampling", "logprob_start_len must be -1"),
    ({"stop": ["ok", ""]}, "bad_sampling", "a stop string must not be empty"),
    ({"max_new_tokens": 65}, "bad_max_new_tokens", "max_new_tokens must be in 1..64, got 65"),
    ({"json_schema": "{not json"}, "bad_grammar", "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "bad_grammar", "must be a JSON schema (an object or a boolean)"),
    ({"json_schema": '{"type": "nonsense"}'}, "bad_grammar",
     "sampling_params.json_schema does not compile"),
    ({"regex": "("}, "bad_grammar", "sampling_params.regex does not compile"),
    ({"ebnf": "start: ("}, "bad_grammar", "sampling_params.ebnf does not compile"),
    ({"json_schema": "{}", "regex": "a"}, "bad_grammar",
     "at most one of sampling_params.json_schema, regex and ebnf (got json_schema, regex)"),
])
def test_out_of_range_values_are_refused_with_the_field_and_range(
        fields: dict[str, Any], reason: str, says: str) -> None:
    exc = refused(**fields)
    assert exc.reason == reason
    assert says in str(exc)
