"""The OpenAI endpoints in process (ASGI transport): completions against the colocated reference
model, plain and streamed, with logprobs; the body a PD router sends; OpenAI error objects for
every refusal; chat on SmolLM2 through the official ``openai`` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import httpx2
import openai
import pytest
import torch

from lifecycle import SamplingParams
from scheduler.cli.main import main
from scheduler.messages import TokenLogprob
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.answers import answer_text
from scheduler.service.app import create_app
from scheduler.service.config import AnswerOptions, Item, ServeConfig
from scheduler.service.core import Service
from scheduler.service.openai_format import (
    StreamText,
    answer_logprobs,
    echoed_logprobs,
    token_bytes,
)
from scheduler.service.openai_schema import ChatCompletionRequest, CompletionRequest
from tests.service_harness import asgi_client, free_port, run, running_service, tokens_of_stream

MODEL = ModelConfig.tiny(seed=3)
SCHED = SchedulerConfig(page_size=4, chunked_prefill_size=16, check_invariants=True)
REFERENCE = ReferenceModel(LlamaModel(MODEL))
TOKENIZER = ByteTokenizer()
#: What SGLang's router (0.3.2) adds to a chat body in PD mode (logged from a stub worker).
ROUTER_CHAT_FIELDS: dict[str, Any] = {
    "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False,
}
ROUTER_COMPLETION_FIELDS: dict[str, Any] = {
    "echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False,
}


def config(role: str = "both", backend: str = "local", **kw: Any) -> ServeConfig:
    return ServeConfig(role=role, backend=backend, model=MODEL, scheduler=SCHED,  # type: ignore[arg-type]
                       pool_pages=64, metadata_slots=8, max_new_tokens_limit=32, **kw)


def greedy(prompt: list[int], n: int, ignore_eos: bool = False) -> list[int]:
    return REFERENCE.generate(prompt, n, (), ignore_eos)


async def post(client: httpx.AsyncClient, path: str, **body: Any) -> httpx.Response:
    return await client.post(path, json=body)


def within(offsets: list[int], text: str, start: int) -> bool:
    """Text offsets that start at ``start`` and run forward inside ``text`` (the reference
    model's random bytes are not always whole characters, so not one per token)."""
    return (offsets[0] == start and offsets == sorted(offsets)
            and offsets[-1] <= len(text))


def sse(text: str) -> list[dict[str, Any]]:
    chunks, done = tokens_of_stream(text)
    assert done, text
    return chunks


# -- completions on the reference model -----------------------------------------------------------


def test_completions_equal_the_reference_plain_streamed_and_as_token_ids() -> None:
    prompt = "Hello, pdlife!"
    want = TOKENIZER.decode(greedy(TOKENIZER.encode(prompt), 12, ignore_eos=True))

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                r = await post(client, "/v1/completions", **body, model="m")
                assert r.status_code == 200, r.text
                got = r.json()
                assert got["object"] == "text_completion" and got["model"] == "m"
                assert got["id"].startswith("cmpl-") and isinstance(got["created"], int)
                (choice,) = got["choices"]
                assert choice == {"index": 0, "text": want, "logprobs": None,
                                  "finish_reason": "length"}
                assert got["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                                        "total_tokens": len(prompt) + 12,
                                        "prompt_tokens_details": {"cached_tokens": 0}}
                for as_ids in (TOKENIZER.encode(prompt), [TOKENIZER.encode(prompt)], [prompt]):
                    r = await post(client, "/v1/completions", **{**body, "prompt": as_ids})
                    assert r.json()["choices"][0]["text"] == want, as_ids
                    assert r.headers["x-request-id"] == r.json()["id"]
                r = await post(client, "/v1/completions", **body, stream=True,
                               stream_options={"include_usage": True})
                chunks = sse(r.text)
                *texts, usage = chunks
                assert r.headers["x-request-id"] == usage["id"]  # OpenAI's header of the id
                assert "".join(c["choices"][0]["text"] for c in texts) == want
                assert [c["choices"][0]["finish_reason"] for c in texts][-1] == "length"
                assert all(c["choices"][0]["finish_reason"] is None for c in texts[:-1])
                assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
                assert all(c["usage"] is None for c in texts)  # OpenAI's null before the last
                r = await post(client, "/v1/completions", **body, stream=True)
                assert all("usage" not in c for c in sse(r.text))

    run(main())


def test_completion_logprobs_describe_the_answer() -> None:
    prompt = TOKENIZER.encode("logprobs")
    want = greedy(prompt, 8, ignore_eos=True)

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                for top in (0, 3):
                    r = await post(client, "/v1/completions", prompt=prompt, max_tokens=8,
                                   temperature=0, ignore_eos=True, logprobs=top)
                    assert r.status_code == 200, r.text
                    choice = r.json()["choices"][0]
                    lp = choice["logprobs"]
                    assert lp["tokens"] == [TOKENIZER.decode([t]) for t in want]
                    assert within(lp["text_offset"], choice["text"], 0)
                    assert all(v <= 0 for v in lp["token_logprobs"])
                    if top == 0:
                        assert lp["top_logprobs"] is None
                        continue
                    for token, value, alternatives in zip(
                            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
                        # Greedy: the chosen token is the most likely one.
                        assert 1 <= len(alternatives) <= top
                        assert alternatives[token] == value == max(alternatives.values())

    run(main())


def test_the_body_a_pd_router_sends_is_accepted_on_both_roles() -> None:
    prompt = TOKENIZER.encode("routed")
    want = greedy(prompt, 6, ignore_eos=True)
    body = {"model": "pdlife", "prompt": "routed", "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "stream": False, **ROUTER_COMPLETION_FIELDS,
            "bootstrap_host": "2.2.2.2", "bootstrap_port": 8998, "bootstrap_room": 12345,
            "some_future_field": {"x": 1},
            # null: each one's default, as OpenAI's spec allows.
            "frequency_penalty": None, "presence_penalty": None, "logit_bias": None,
            "repetition_penalty": None, "min_tokens": None}

    async def main() -> None:
        # The fake backend: prefill answers its one token, decode computes the prompt itself.
        for role, expected in (("prefill", want[:1]), ("decode", want)):
            with running_service(config(role, "fake")) as service:
                async with asgi_client(service) as client:
                    r = await post(client, "/v1/completions", **body)
                    assert r.status_code == 200, r.text
                    choice = r.json()["choices"][0]
                    assert choice["text"] == TOKENIZER.decode(expected), role
                    assert r.json()["usage"]["completion_tokens"] == len(expected)
                    r = await post(client, "/v1/completions", **body | {"stream": True})
                    assert "".join(c["choices"][0]["text"] for c in sse(r.text)) == \
                        TOKENIZER.decode(expected)

    run(main())


def test_echo_writes_the_prompt_and_its_logprobs_before_the_answer() -> None:
    prompt = "Echo, echo"
    ids = TOKENIZER.encode(prompt)
    want = TOKENIZER.decode(greedy(ids, 6, ignore_eos=True))
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "echo": True}

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await post(client, "/v1/completions", **body)
                assert r.json()["choices"][0]["text"] == prompt + want
                assert r.json()["choices"][0]["logprobs"] is None
                assert r.json()["usage"]["prompt_tokens"] == len(ids)
                # The prompt's logprobs as /generate computes them from position 0.
                g = (await post(client, "/generate", input_ids=ids, return_logprob=True,
                                logprob_start_len=0, top_logprobs_num=2, sampling_params={
                                    "max_new_tokens": 6, "temperature": 0,
                                    "ignore_eos": True})).json()["meta_info"]
                for top in (0, 2):
                    r = await post(client, "/v1/completions", **body, logprobs=top)
                    assert r.status_code == 200, r.text
                    choice = r.json()["choices"][0]
                    assert choice["text"] == prompt + want
                    lp = choice["logprobs"]
                    assert "".join(lp["tokens"]) == prompt + want
                    offsets = lp["text_offset"]  # the prompt's are ASCII, one per byte
                    assert offsets[:len(prompt)] == list(range(len(prompt)))
                    assert within(offsets[len(prompt):], choice["text"], len(prompt))
                    assert lp["token_logprobs"] == [
                        v for v, _, _ in g["input_token_logprobs"] + g["output_token_logprobs"]]
                    assert lp["token_logprobs"][0] is None  # nothing predicts the first token
                    if top == 0:
                        assert lp["top_logprobs"] is None
                        continue
                    assert lp["top_logprobs"][0] is None
                    tops = g["input_top_logprobs"][1:] + g["output_top_logprobs"]
                    # Two alternatives with one text (invalid bytes): the more likely stays.
                    assert lp["top_logprobs"][1:] == [
                        {TOKENIZER.decode([t]): v for v, t, _ in reversed(alts)}
                        for alts in tops]
                    # A stream's chunks add up to the same text and logprobs.
                    r = await post(client, "/v1/completions", **body, logprobs=top,
                                   stream=True)
                    texts = [c["choices"][0] for c in sse(r.text)]
                    assert texts[0]["text"] == prompt  # the echo comes first
                    assert "".join(c["text"] for c in texts) == prompt + want
                    joined = {key: [v for c in texts for v in c["logprobs"][key]]
                              for key in lp}
                    assert joined == lp

    run(main())


def test_no_new_tokens_scores_the_prompt_alone() -> None:
    """``max_new_tokens``/``max_tokens`` 0: the prompt's logprobs (with ``echo``, its text) and no
    token, plain and streamed, colocated and on a decode worker; nothing stays live."""
    prompt = "Score me"
    ids = TOKENIZER.encode(prompt)
    scored = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                one = (await post(client, "/generate", input_ids=ids, **scored,
                                  sampling_params={"max_new_tokens": 1})).json()["meta_info"]
                for stream in (False, True):
                    r = await post(client, "/generate", input_ids=ids, **scored, stream=stream,
                                   sampling_params={"max_new_tokens": 0})
                    assert r.status_code == 200, r.text
                    got = sse(r.text)[-1] if stream else r.json()
                    assert (got["text"], got["output_ids"]) == ("", [])
                    meta = got["meta_info"]
                    assert meta["finish_reason"] == {"type": "length", "length": 0}
                    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 0)
                    assert meta["input_token_logprobs"] == one["input_token_logprobs"]
                    assert meta["input_top_logprobs"] == one["input_top_logprobs"]
                    assert meta["output_token_logprobs"] == []
                body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
                r = await post(client, "/v1/completions", **body)
                assert r.status_code == 200, r.text
                choice, usage = r.json()["choices"][0], r.json()["usage"]
                assert (choice["text"], choice["finish_reason"]) == (prompt, "length")
                assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 0)
                lp = choice["logprobs"]
                assert "".join(lp["tokens"]) == prompt
                assert lp["token_logprobs"] == [v for v, _, _ in one["input_token_logprobs"]]
                r = await post(client, "/v1/completions", **body, stream=True)
                chunks = [c["choices"][0] for c in sse(r.text)]
                assert "".join(c["text"] for c in chunks) == prompt
                assert chunks[-1]["finish_reason"] == "length"
                r = await post(client, "/v1/completions", prompt=prompt, max_tokens=0)
                assert r.json()["choices"][0]["text"] == ""
                assert service.wait_drained(10)
        with running_service(config("decode", "fake")) as service:
            async with asgi_client(service) as client:
                r = await post(client, "/generate", input_ids=ids, bootstrap_host="2.2.2.2",
                               bootstrap_port=8998, bootstrap_room=5,
                               sampling_params={"max_new_tokens": 0})
                assert (r.json()["output_ids"], r.json()["meta_info"]["completion_tokens"]) == (
                    [], 0)
                assert service.wait_drained(10)

    run(main())


@pytest.mark.parametrize("grammar", [
    {"json_schema": '{"$ref": "#"}'},  # refers only to itself: no value ever matches
    {"ebnf": 'root ::= root "x"'},  # no base case
])
def test_a_grammar_that_can_never_be_completed_is_the_clients_fault_on_every_role(
        grammar: dict[str, str]) -> None:
    """The fake decode draws the first token itself; its grammar refusing it was a 500."""
    async def main() -> None:
        for role in ("prefill", "decode", "both"):
            backend = "local" if role == "both" else "fake"
            with running_service(config(role, backend)) as service:
                async with asgi_client(service) as client:
                    r = await post(client, "/generate", text="Hi", bootstrap_host="2.2.2.2",
                                   bootstrap_port=8998, bootstrap_room=21,
                                   sampling_params={"max_new_tokens": 3, **grammar})
                    assert r.status_code == 400, (role, r.text)
                    assert "the grammar engine cannot run this grammar" in r.text, (role, r.text)
                    assert service.wait_drained(10)

    run(main())


def test_a_batch_of_prompts_answers_n_choices_per_prompt_in_order() -> None:
    prompts = ["first prompt", "the second"]
    body = {"max_tokens": 5, "temperature": 0.8, "seed": 7, "ignore_eos": True}

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                alone = []
                for p in prompts:
                    r = await post(client, "/v1/completions", prompt=p, n=2, **body)
                    alone += [c["text"] for c in r.json()["choices"]]
                for batch in (prompts, [TOKENIZER.encode(p) for p in prompts]):
                    r = await post(client, "/v1/completions", prompt=batch, n=2, **body)
                    assert r.status_code == 200, r.text
                    got = r.json()
                    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
                    assert [c["text"] for c in got["choices"]] == alone
                    assert got["usage"]["prompt_tokens"] == sum(map(len, prompts))
                    assert got["usage"]["completion_tokens"] == 4 * 5
                r = await post(client, "/v1/completions", prompt=prompts, n=2, **body,
                               stream=True, echo=True, stream_options={"include_usage": True})
                *chunks, usage = sse(r.text)
                texts = ["", "", "", ""]
                for c in chunks:
                    texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
                assert texts == [prompts[k // 2] + alone[k] for k in range(4)]
                assert usage["usage"]["prompt_tokens"] == sum(map(len, prompts))

    run(main())


def test_a_decode_worker_echoes_text_and_refuses_echoed_logprobs() -> None:
    prompt = TOKENIZER.encode("decoded")
    want = greedy(prompt, 4, ignore_eos=True)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "echo": True, "bootstrap_host": "2.2.2.2", "bootstrap_port": 8998,
            "bootstrap_room": 77}

    async def main() -> None:
        with running_service(config("decode", "fake")) as service:
            async with asgi_client(service) as client:
                r = await post(client, "/v1/completions", **body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == TOKENIZER.decode(prompt + want)
                r = await post(client, "/v1/completions", **body | {"bootstrap_room": 78},
                               logprobs=0)
                assert r.status_code == 400
                assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
                    "unsupported", "echo")

    run(main())


# -- refusals -----------------------------------------------------------------------------------

REFUSED: list[tuple[str, dict[str, Any], str, str | None]] = [
    ("/v1/completions", {"prompt": []}, "empty_prompt", "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "empty_prompt", "prompt"),
    ("/v1/completions", {"prompt": ["one", "two"], "n": 2, "bootstrap_host": ["h", "h", "h"],
                         "bootstrap_port": 9, "bootstrap_room": 5}, "bad_bootstrap",
     "bootstrap_host"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "bad_sampling", "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "bad_sampling", "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "bootstrap_host": "h", "bootstrap_port": 9,
                         "bootstrap_room": [5, 5]}, "bad_bootstrap", "bootstrap_room"),
    ("/v1/completions", {"prompt": "x", "bootstrap_host": ["h"], "bootstrap_port": [9],
                         "bootstrap_room": [5]}, "bad_bootstrap", "bootstrap_host"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "invalid_request",
     "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -3}, "invalid_request",
     "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"3": 101}}, "invalid_request",
     "logit_bias.3"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "bad_sampling", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "bad_sampling",
     "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1000": 1}}, "bad_token_id",
     "logit_bias"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "unsupported", "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "unsupported", "best_of"),
    # /generate refuses it too (it was ignored here).
    ("/v1/completions", {"prompt": "x", "spaces_between_special_tokens": False}, "unsupported",
     "spaces_between_special_tokens"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "invalid_request",
     "response_format.type"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}},
     "bad_grammar", "response_format.json_schema"),
    ("/v1/completions", {"prompt": "x", "regex": "a", "ebnf": "start: \"a\""}, "bad_grammar",
     "ebnf"),
    ("/v1/completions", {"prompt": "x", "regex": "a", "response_format": {
        "type": "json_object"}}, "bad_grammar", "regex"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "invalid_request", "logprobs"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "invalid_request", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "invalid_request", "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "invalid_request", "seed"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "bad_sampling", "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 33}, "bad_max_new_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": ""}, "empty_prompt", "prompt"),
    ("/v1/completions", {"prompt": [1, 999]}, "bad_token_id", "prompt"),
    ("/v1/completions", {}, "invalid_request", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "no_chat_template", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "invalid_request", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 21, "logprobs": True}, "invalid_request",
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, "invalid_request",
     "tools.0.function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "functions": [{"name": "f"}]}, "unsupported", "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "unsupported",
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "sticker"}]}]}, "invalid_request", "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": []}, "invalid_request", "messages"),
    # OpenAI takes refusal parts in an assistant's messages only.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "refusal", "refusal": "no"}]}]}, "invalid_request",
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "refusal", "refusal": "no"}]},
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "refusal", "refusal": "no"}]}]},
     "invalid_request", "messages.2.content.1.type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
     "invalid_request", "messages.0.role"),
    # Only an assistant's content may be null (a message that only calls tools).
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "invalid_request",
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
        {"role": "tool", "content": None, "tool_call_id": "c1"}]}, "invalid_request",
     "messages.2.content"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42"}]}, "invalid_request",
     "messages.1.tool_calls.0.function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "modalities": ["text", "audio"]}, "unsupported", "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "audio": {"voice": "alloy", "format": "wav"}}, "unsupported",
     "audio"),
]


@pytest.mark.parametrize(("path", "body", "code", "param"), REFUSED,
                         ids=[f"{p[4:]}-{c}-{m}" for p, _, c, m in REFUSED])
def test_refusals_are_openai_errors_naming_the_field(path: str, body: dict[str, Any], code: str,
                                                     param: str | None) -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await post(client, path, **body)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "invalid_request_error"
                assert (error["code"], error["param"]) == (code, param), error
                if code == "unsupported":
                    assert param is not None and param in error["message"]
                # The request's id, as on an answer (the client's ``_request_id``).
                prefix = "chatcmpl-" if path.endswith("chat/completions") else "cmpl-"
                assert r.headers["x-request-id"].startswith(prefix), r.headers
                metrics = (await client.get("/metrics")).text
                assert f'pdlife_http_rejected_total{{reason="{code}"}} 1.0' in metrics

    run(main())


def test_vllms_constraint_fields_are_read_as_their_sglang_equivalents() -> None:
    """Clients written for vLLM send guided_* (and structured_outputs): ignored as unknown
    fields, they left the answer unconstrained."""
    choices = ['yes', 'no', 'say "maybe"\n']
    cases: list[tuple[dict[str, Any], str]] = [
        ({"guided_choice": choices}, "|".join(re.escape(c) for c in choices)),
        ({"guided_regex": "[a-c]{3}"}, "[a-c]{3}"),
        ({"guided_json": {"type": "boolean"}}, "true|false"),
        ({"guided_json": '{"type": "boolean"}'}, "true|false"),
        ({"guided_grammar": 'start: "x" "y"+'}, "xy+"),
        ({"structured_outputs": {"choice": choices}}, "|".join(re.escape(c) for c in choices)),
        ({"structured_outputs": {"regex": "[0-9]{2}"}}, "[0-9]{2}"),
        ({"structured_outputs": {"json": {"type": "null"}}}, "null"),
        ({"structured_outputs": {"json_object": True}}, r"\{[\s\S]*"),  # an object begun
    ]

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                for fields, pattern in cases:
                    for seed in range(3):
                        r = await post(client, "/v1/completions", prompt="x", max_tokens=20,
                                       temperature=1.0, seed=seed, **fields)
                        assert r.status_code == 200, (fields, r.text)
                        text = r.json()["choices"][0]["text"]
                        assert re.fullmatch(pattern, text), (fields, text)
                r = await post(client, "/v1/completions", prompt="x", regex="a",
                               guided_choice=["b"])
                error = r.json()["error"]
                assert (error["code"], error["param"]) == ("bad_grammar", "guided_choice")
                assert "give at most one constraint, got regex and guided_choice" in (
                    error["message"])
                r = await post(client, "/v1/completions", prompt="x", guided_grammar="start: (")
                error = r.json()["error"]
                assert (error["code"], error["param"]) == ("bad_grammar", "guided_grammar")
                assert error["message"].startswith("guided_grammar does not compile"), error

    run(main())


def test_a_request_beyond_the_context_is_refused_in_openais_words() -> None:
    """Clients look for ``context_length_exceeded`` or "maximum context length"; ``param`` is
    ``max_tokens`` when the prompt alone fits (it blamed the prompt)."""
    async def main() -> None:
        with running_service(config()) as service:  # a pool of 256 tokens
            async with asgi_client(service) as client:
                r = await post(client, "/v1/completions", prompt="x" * 239, max_tokens=30)
                error = r.json()["error"]
                assert r.status_code == 400 and error["type"] == "invalid_request_error"
                assert (error["code"], error["param"]) == ("context_length_exceeded",
                                                           "max_tokens"), error
                assert error["message"].startswith(
                    "This server's (its KV pool's) maximum context length is 256 tokens. "
                    "However, you requested "
                    "269 tokens (239 in the prompt, 30 in the completion). Please reduce the "
                    "length of the prompt or max_tokens."), error
                r = await post(client, "/v1/completions", prompt="x" * 300, max_tokens=2)
                assert r.json()["error"]["param"] == "prompt", r.text
                metrics = (await client.get("/metrics")).text  # the label /generate counts
                assert 'pdlife_http_rejected_total{reason="prompt_too_long"} 2.0' in metrics
                r = await client.post("/generate", json={
                    "text": "x" * 239, "sampling_params": {"max_new_tokens": 30}})
                assert r.json()["error"]["type"] == "prompt_too_long", r.text
        short = attrs.evolve(MODEL, max_position=64)  # the context, not the pool, is the limit
        with running_service(attrs.evolve(config(), model=short)) as service:
            async with asgi_client(service) as client:
                # The numbers are the client's: max_tokens as sent.
                r = await post(client, "/v1/completions", prompt="x" * 49, max_tokens=20)
                error = r.json()["error"]
                assert (error["code"], error["param"]) == ("context_length_exceeded",
                                                           "max_tokens"), error
                assert error["message"].startswith(
                    "This model's maximum context length is 64 tokens. However, you requested "
                    "69 tokens (49 in the prompt, 20 in the completion)."), error
                # An answer's last token takes no position: 49 + 16 fits a context of 64.
                r = await post(client, "/v1/completions", prompt="x" * 49, max_tokens=16,
                               ignore_eos=True)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 16, r.text

    run(main())


def test_models_are_retrieved_and_a_wrong_path_is_an_openai_error() -> None:
    async def main() -> None:
        with running_service(config(model_name="org/tiny")) as service:
            async with asgi_client(service) as client:
                card = (await client.get("/v1/models/org/tiny")).json()
                assert card == (await client.get("/v1/models")).json()["data"][0]
                r = await client.get("/v1/models/gpt-4")
                assert r.status_code == 404
                assert r.json()["error"] | {"message": ""} == {
                    "message": "", "type": "invalid_request_error", "param": "model",
                    "code": "model_not_found"}
                r = await post(client, "/v1/embeddings", input="x")
                assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
                assert r.json()["error"]["type"] == "invalid_request_error"
                r = await client.get("/v1/chat/completions")
                assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")
                r = await client.get("/no_such_route")  # elsewhere: /generate's shape
                assert r.json()["error"] == {"type": "http_error", "rid": None,
                                             "message": "GET /no_such_route: Not Found"}
                r = await client.get("/generate")
                assert r.status_code == 405, r.text
                assert r.json()["error"]["message"] == "GET /generate: Method Not Allowed"
                metrics = (await client.get("/metrics")).text  # one label for every model
                for status in ("200", "404"):
                    assert (f'pdlife_http_requests_total{{method="GET",'
                            f'route="/v1/models/{{model}}",status="{status}"}}') in metrics
            async with openai_client(service) as openai_api:
                assert (await openai_api.models.retrieve("org/tiny")).id == "org/tiny"
                with pytest.raises(openai.NotFoundError):
                    await openai_api.models.retrieve("gpt-4")

    run(main())


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool", "function"])
def test_a_refusal_part_outside_an_assistant_message_is_refused_naming_it(role: str) -> None:
    """It was taken as text on any role; OpenAI answers 400."""
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await post(client, "/v1/chat/completions", messages=[
                    {"role": "user", "content": "hi"},
                    {"role": role, "content": [{"type": "refusal", "refusal": "no"}]}])
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert (error["code"], error["param"]) == (
                    "invalid_request", "messages.1.content.0.type"), error
                assert error["message"] == (
                    f"messages.1.content.0.type: a {role} message (messages.1) has a refusal "
                    "part; refusal parts go in assistant messages only (send the text as a "
                    "text part)")

    run(main())


def test_a_refusal_of_a_list_names_the_field_not_its_value() -> None:
    functions = [{"name": "get_weather", "parameters": {}}]

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await post(client, "/v1/chat/completions", functions=functions,
                               messages=[{"role": "user", "content": "hi"}])
                message = r.json()["error"]["message"]
                assert message == ("functions is not supported by this server (leave it out, "
                                   "or send null); functions and function_call are OpenAI's "
                                   "older names: send tools and tool_choice")
                r = await post(client, "/v1/completions", prompt="x", best_of=3)
                assert r.json()["error"]["message"] == (
                    "best_of=3 is not supported by this server (leave it out, or send null)")

    run(main())


def test_null_is_each_fields_default() -> None:
    """What the ``openai`` client sends for an option its caller left ``None``."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "seed": None,
             "stop": None, "stream_options": None, "response_format": None, "user": None,
             "rid": None, "top_k": None, "ignore_eos": None}

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                for path, body in (
                        ("/v1/completions", {"prompt": "null", "max_tokens": 4, "echo": None,
                                             "logprobs": None}),
                        ("/v1/chat/completions", {
                            "messages": [{"role": "user", "content": "hi", "name": None}],
                            "max_tokens": 4, "logprobs": None, "top_logprobs": None})):
                    defaults = await post(client, path, **body, seed=5)
                    r = await post(client, path, **body | nulls | {"seed": 5})
                    assert r.status_code == defaults.status_code, r.text
                    if path == "/v1/completions":
                        assert r.json()["choices"] == defaults.json()["choices"]

    run(main())


def test_a_body_that_is_not_json_and_a_draining_server_answer_openai_errors() -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await client.post("/v1/completions", content=b"{nope",
                                      headers={"content-type": "application/json"})
                assert r.status_code == 400
                assert r.json()["error"]["code"] == "malformed_json"
                assert r.headers["x-request-id"].startswith("cmpl-")  # a fresh id
                r = await client.post("/v1/chat/completions", content=b"prompt=x",
                                      headers={"content-type": "text/plain"})
                assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
                # A body that fails the schema but names its rid: the error carries it.
                r = await post(client, "/v1/chat/completions", messages="x", rid="abc1")
                assert (r.status_code, r.headers["x-request-id"]) == (400, "abc1")
                # One a header cannot carry is percent-encoded (it was a 500).
                r = await post(client, "/v1/completions", echo=False, rid="\u0100 x")
                assert (r.status_code, r.headers["x-request-id"]) == (400, "%C4%80%20x")
                service.begin_drain()
                r = await post(client, "/v1/completions", prompt="x")
                assert r.status_code == 503
                assert r.json()["error"] == {
                    "message": "the server is draining (shutting down)", "type": "server_error",
                    "param": None, "code": "draining"}

    run(main())


# -- streaming text -----------------------------------------------------------------------------


def _item(**sampling: Any) -> Item:
    return Item("s", (1,), SamplingParams(16, **sampling), "local", 0, 1)


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_a_stream_never_sends_text_a_stop_will_cut(no_stop_trim: bool) -> None:
    item = attrs.evolve(_item(stop=("XY", "QQQ")),
                        options=AnswerOptions(no_stop_trim=no_stop_trim))
    ids = TOKENIZER.encode("abXcQQXY")
    text = StreamText(TOKENIZER, item)
    sent = "".join(text.more([t]) for t in ids)
    final = answer_text(TOKENIZER, item, ids, "XY")
    assert final == ("abXcQQXY" if no_stop_trim else "abXcQQ")
    if not no_stop_trim:
        assert "XY" not in sent and final.startswith(sent)
    assert sent + text.rest(final) == final


def test_a_stream_holds_back_an_incomplete_character_and_a_possible_stop_token() -> None:
    snowman = TOKENIZER.encode("a☃")
    text = StreamText(TOKENIZER, _item())
    assert [text.more([t]) for t in snowman] == ["a", "", "", "☃"]
    held = StreamText(TOKENIZER, _item(stop_token_ids=(ord("!"),)))
    assert [held.more([t]) for t in TOKENIZER.encode("ab!")] == ["", "a", "b"]
    assert held.rest(answer_text(TOKENIZER, held.item, TOKENIZER.encode("ab!"), ord("!"))) == ""


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Llama 2-style tokenizer (``▁`` for spaces, byte fallback), as a checkpoint's."""
    from scheduler.model.checkpoint import TokenizerSource
    from scheduler.model.hf_tokenizer import load_tokenizer
    from tests.test_hf_tokenizer import _sentencepiece_style

    where = tmp_path_factory.mktemp("spm")
    _sentencepiece_style(where)
    return load_tokenizer(TokenizerSource(directory=where))


def test_a_stream_of_byte_fallback_tokens_ends_as_the_answer(sentencepiece: Any) -> None:
    """A byte the next one turns invalid ("I" then 0xDD: the group decodes as two replacement
    characters) must not be streamed before its group closes: the text sent would change under
    it, and the stream, which only appends, lost the rest of the answer."""
    tok = sentencepiece
    byte = {b: tok.tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0x49, 0xDD, 0xE2, 0x98, 0x83)}
    words = tok.encode(" the capital", add_special_tokens=False)
    for ids in ([*words, byte[0x49], byte[0xDD], *words],  # a group that ends invalid
                [*words, byte[0xE2], byte[0x98], byte[0x83], *words],  # ☃ from three bytes
                [byte[0x49], byte[0xDD]]):  # the answer ends inside the group
        item = Item("s", tuple(tok.encode("Say")), SamplingParams(16), "local", 0, 1)
        text = StreamText(tok, item)
        sent = "".join(text.more([t]) for t in ids)
        final = answer_text(tok, item, ids, None)
        assert sent + text.rest(final) == final, (sent, final)
    assert "\ufffd\ufffd" in final  # the invalid group, as the tokenizer decodes it
    assert "☃" in answer_text(tok, item, [*words, byte[0xE2], byte[0x98], byte[0x83]], None)


def test_sentencepiece_tokens_keep_their_space_in_text_logprobs_and_offsets(
        sentencepiece: Any) -> None:
    """An answer continues its prompt: its first token's ``▁`` is a space (decoding the answer
    alone strips it, as at a text's start); a token's text and bytes are its piece's (``▁`` a
    space, ``<0xNN>`` its byte), and the offsets index the text."""
    tok = sentencepiece
    item = Item("s", tuple(tok.encode("The capital is")), SamplingParams(16, return_logprob=True),
                "local", 0, 1)
    ids = [*tok.encode(" the capital", add_special_tokens=False),
           tok.tokenizer.token_to_id("<0x41>")]
    text = answer_text(tok, item, ids, None)
    assert text == " the capitalA"
    assert tok.decode(ids) == "the capitalA"  # alone, the leading space goes
    logprobs = answer_logprobs(tok, item, [TokenLogprob(t, -1.0) for t in ids], chat=False)
    assert logprobs is not None and "".join(logprobs.tokens) == text
    assert [text[o:o + len(t)] for o, t in zip(logprobs.text_offset, logprobs.tokens,
                                                strict=True)] == logprobs.tokens
    assert token_bytes(tok, ids[-1]) == [0x41]
    assert bytes(token_bytes(tok, ids[0])).decode().startswith(" ")
    # An echoed prompt: its first word's piece has no space in the text it starts.
    echo = "The capital is"
    echoed = echoed_logprobs(tok, item, [TokenLogprob(t, None) for t in item.input_ids])
    assert echoed is not None and echoed.tokens[0] == "<s>"  # BOS: in the list, not the text
    assert [echo[o:o + len(t)] for o, t in zip(echoed.text_offset[1:], echoed.tokens[1:],
                                               strict=True)] == echoed.tokens[1:]
    assert "".join(echoed.tokens[1:]) == echo


# -- chat on SmolLM2, through the official client -------------------------------------------------


@pytest.fixture(scope="module")
def chat_config(smollm2: Any) -> ServeConfig:
    return ServeConfig(role="both", backend="local", served=smollm2, model_name="smollm2",
                       scheduler=SchedulerConfig(page_size=16, chunked_prefill_size=64),
                       pool_pages=64, metadata_slots=8)


@contextlib.asynccontextmanager
async def openai_client(service: Service) -> AsyncIterator[openai.AsyncOpenAI]:
    # The openai client's own HTTP library (httpx2) over the app, in process.
    transport = httpx2.ASGITransport(app=create_app(service))
    async with httpx2.AsyncClient(transport=transport, base_url="http://pdlife/v1") as http:
        yield openai.AsyncOpenAI(base_url="http://pdlife/v1", api_key="none", http_client=http,
                                 max_retries=0)


QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


def completion(config: ServeConfig, **body: Any) -> Any:
    """One ``/v1/completions`` answer through the ``openai`` client, from a service of
    ``config`` started for it."""
    async def main() -> Any:
        with running_service(config) as service:
            async with openai_client(service) as client:
                return await client.completions.create(model="smollm2", **body)

    return run(main())


def test_chat_answers_as_the_colocated_model_through_the_openai_client(
        smollm2: Any, chat_config: ServeConfig) -> None:
    want_ids = smollm2.generate(smollm2.encode_messages(QUESTION), 16)
    want = smollm2.decode(want_ids)
    assert want == "The capital of France is Paris."

    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                r = await client.chat.completions.create(
                    model="smollm2", messages=QUESTION, max_tokens=16, temperature=0,
                    logprobs=True, top_logprobs=2)
                choice = r.choices[0]
                assert (choice.message.role, choice.message.content) == ("assistant", want)
                assert choice.finish_reason == "stop"
                assert r.object == "chat.completion" and r.model == "smollm2"
                assert r.usage is not None and r.usage.completion_tokens == len(want_ids)
                assert choice.logprobs is not None and choice.logprobs.content is not None
                entries = choice.logprobs.content
                assert [e.token for e in entries] == [
                    smollm2.tokenizer.decode([t], skip_special_tokens=False) for t in want_ids]
                assert "".join(e.token for e in entries[:-1]) == want  # the last is EOS
                for e, token in zip(entries, want_ids, strict=True):
                    assert bytes(e.bytes or []) == bytes(token_bytes(smollm2.tokenizer, token))
                    assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
                    assert e.top_logprobs[0].logprob == e.logprob
                # The same as text parts, streamed, with the usage chunk.
                parts: Any = [{"role": "user", "content": [
                    {"type": "text", "text": "What is the capital of France?"}]}]
                stream = await client.chat.completions.create(
                    model="smollm2", messages=parts, max_completion_tokens=16,
                    temperature=0, stream=True, stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                assert chunks[0].choices[0].delta.role == "assistant"
                assert "".join(c.choices[0].delta.content or "" for c in chunks
                               if c.choices) == want
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
                assert chunks[-1].choices == [] and chunks[-1].usage is not None

    run(main())


def test_an_assistants_refusal_part_in_the_history_is_its_text(
        chat_config: ServeConfig) -> None:
    def history(said: Any) -> Any:
        return [{"role": "user", "content": "Tell me a secret."},
                {"role": "assistant", "content": said},
                {"role": "user", "content": "What is the capital of France?"}]

    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                answers = [await client.chat.completions.create(
                    model="smollm2", messages=history(said), max_completion_tokens=4,
                    temperature=0)
                    for said in ("I cannot share that.",
                                 [{"type": "refusal", "refusal": "I cannot share that."}])]
                assert answers[0].usage is not None and answers[1].usage is not None
                assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens
                assert (answers[0].choices[0].message.content
                        == answers[1].choices[0].message.content)

    run(main())


def test_a_chat_with_a_system_message_equals_pdlife_generate(
        chat_config: ServeConfig, capsys: pytest.CaptureFixture[str]) -> None:
    system, question = "Answer in one word.", "What is the capital of France?"
    assert main(["generate", "--model", "smollm2", "--chat", "--system", system,
                 "--prompt", question, "--max-new-tokens", "12"]) == 0
    want = json.loads(capsys.readouterr().out)

    async def ask() -> Any:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                return await client.chat.completions.create(
                    model="smollm2", max_tokens=12, temperature=0, messages=[
                        {"role": "system", "content": system},
                        {"role": "user", "content": question}])

    r = run(ask())
    assert r.choices[0].message.content == want["text"]
    assert r.usage is not None and r.usage.prompt_tokens == want["prompt_tokens"]


def test_chat_without_max_tokens_may_fill_the_pool(smollm2: Any, chat_config: ServeConfig
                                                  ) -> None:
    """Chat's default answer is what the KV pool (64 tokens here) leaves after the prompt,
    counting that the answer's last token takes none: ``max_model_len`` + 1 in all."""
    small = attrs.evolve(chat_config, pool_pages=4)

    async def main() -> None:
        with running_service(small) as service:
            async with openai_client(service) as client:
                (card,) = (await client.models.list()).data
                assert card.model_extra is not None and card.model_extra["max_model_len"] == 64
                r = await client.chat.completions.create(
                    model="smollm2", messages=QUESTION, temperature=0,
                    extra_body={"ignore_eos": True})
                assert r.usage is not None and r.choices[0].finish_reason == "length"
                assert r.usage.prompt_tokens + r.usage.completion_tokens == 64 + 1, r.usage

    run(main())


def test_chat_sampling_with_a_seed_reproduces(
        smollm2: Any, chat_config: ServeConfig) -> None:
    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                async def sampled(seed: int) -> str:
                    r = await client.chat.completions.create(
                        model="smollm2", messages=QUESTION, max_tokens=10,
                        temperature=1.0, top_p=0.95, seed=seed)
                    return r.choices[0].message.content or ""

                first, again, other = await asyncio.gather(sampled(7), sampled(7), sampled(8))
                assert first == again and first
                # Ten sampled tokens of two seeds: equal only by a rare accident.
                assert first != other
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="smollm2", messages=QUESTION, frequency_penalty=2.5)
                assert refused.value.code == "invalid_request"
                assert refused.value.param == "frequency_penalty"

    run(main())


def test_a_bias_and_min_tokens_answer_as_transformers_generate(
        smollm2: Any, hf_smollm2: Any, chat_config: ServeConfig) -> None:
    """Greedy with ``logit_bias`` (the plain answer's first token banned: the prefill side's
    draw) and with ``min_tokens`` (EOS excluded until then: the decode side's), against
    transformers' own ``generate`` with ``sequence_bias`` and ``min_new_tokens``."""
    prompt = smollm2.encode_messages(QUESTION)
    eos = sorted(smollm2.eos_token_ids)
    hf_model, _ = hf_smollm2

    def transformers_text(**options: Any) -> tuple[str, int]:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), do_sample=False, eos_token_id=eos,
                                    pad_token_id=eos[0], **options)[0, len(prompt):].tolist()
        return smollm2.decode(out[:-1] if out[-1] in eos else out), len(out)

    banned = smollm2.generate(prompt, 1)[0]
    want_biased = transformers_text(max_new_tokens=12, sequence_bias={(banned,): -100.0})
    want_long = transformers_text(max_new_tokens=20, min_new_tokens=14)
    assert want_long[1] >= 14

    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                async def answer(**options: Any) -> tuple[str, int]:
                    r = await client.chat.completions.create(
                        model="smollm2", messages=QUESTION, temperature=0, **options)
                    assert r.usage is not None
                    return r.choices[0].message.content or "", r.usage.completion_tokens

                assert await answer(max_tokens=12, logit_bias={str(banned): -100}) == want_biased
                # SGLang's extension: the openai client sends it in extra_body.
                assert await answer(max_tokens=20, extra_body={"min_tokens": 14}) == want_long

    run(main())


def test_echo_scores_a_batch_of_prompts_as_transformers_does(
        smollm2: Any, hf_smollm2: Any, chat_config: ServeConfig) -> None:
    """What an evaluation harness sends to score continuations (``echo``, ``logprobs``, one
    token, a batch of token-id prompts), through the ``openai`` client: each prompt token's
    logprob is transformers' log-softmax of the position before it."""
    hf_model, _ = hf_smollm2
    context = smollm2.encode("The capital of France is")
    prompts = [context + smollm2.encode(c) for c in (" Paris", " a large city in Europe")]
    r = completion(chat_config, prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                   temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(prompts, r.choices, strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        assert choice.text.startswith(smollm2.decode(prompt))
        assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt])).logits[0].float()
        want = torch.log_softmax(logits, -1)
        for i, token in enumerate(prompt[1:], start=1):
            assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, token]), abs=2e-3)
        # The one generated token is the greedy one after the prompt.
        assert lp.token_logprobs[-1] == pytest.approx(float(want[-1].max()), abs=2e-3)
    assert r.usage is not None and r.usage.prompt_tokens == sum(map(len, prompts))


def test_text_offsets_index_the_text_of_characters_split_across_tokens(
        smollm2: Any, chat_config: ServeConfig) -> None:
    """Byte-level tokens split "日本語 🤖" inside characters: a character counts once, at the
    token that completes it, so every offset points into the text the client reads."""
    prompt = "café 日本語 🤖 ok"
    ids = smollm2.encode(prompt)
    r = completion(chat_config, prompt=prompt, echo=True, max_tokens=4, logprobs=0,
                   temperature=0)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert lp is not None and lp.text_offset is not None and lp.tokens is not None
    offsets = lp.text_offset
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for i in range(len(ids) + 1):  # each prompt token starts where the text of those before ends
        before = smollm2.decode(ids[:i]).rstrip("\ufffd")
        assert i == len(ids) or offsets[i] == len(before), (i, before)
        assert text.startswith(before)
    assert offsets[len(ids)] == len(prompt)  # the answer starts after the echoed prompt


def test_stop_strings_end_the_answer_plain_and_streamed(smollm2: Any,
                                                      chat_config: ServeConfig) -> None:
    # Greedy, the model continues "The capital of France is" with " Paris.\n\nThe answer is".
    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                plain = await client.completions.create(
                    model="smollm2", prompt="The capital of France is", max_tokens=8,
                    temperature=0, stop=["."])
                stream = await client.completions.create(
                    model="smollm2", prompt="The capital of France is", max_tokens=8,
                    temperature=0, stop=["."], stream=True)
                chunks = [c async for c in stream]
                kept = await client.completions.create(
                    model="smollm2", prompt="The capital of France is", max_tokens=8,
                    temperature=0, stop=["."], extra_body={"no_stop_trim": True})
        assert (plain.choices[0].text, plain.choices[0].finish_reason) == (" Paris", "stop")
        assert "".join(c.choices[0].text for c in chunks) == " Paris"
        assert kept.choices[0].text == " Paris."
        assert plain.usage is not None and plain.usage.completion_tokens == 2

    run(main())


def test_stop_regexes_end_the_answer_plain_and_streamed(smollm2: Any,
                                                      chat_config: ServeConfig) -> None:
    """SGLang's ``stop_regex`` on the OpenAI routes (an extra field): a bounded pattern, and one
    without a bound, whose stream holds its text back until the answer ends."""
    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                for pattern in (r"\.\s", r"[.!?]\s*"):
                    body = {"stop_regex": pattern}
                    plain = await client.completions.create(
                        model="smollm2", prompt="The capital of France is", max_tokens=8,
                        temperature=0, extra_body=body)
                    stream = await client.completions.create(
                        model="smollm2", prompt="The capital of France is", max_tokens=8,
                        temperature=0, stream=True, extra_body=body)
                    chunks = [c async for c in stream]
                    assert (plain.choices[0].text, plain.choices[0].finish_reason) == (
                        " Paris", "stop"), pattern
                    assert "".join(c.choices[0].text for c in chunks) == " Paris", pattern

    run(main())


def test_the_openapi_schema_lists_the_openai_bodies() -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                schema = (await client.get("/openapi.json")).json()
                for path in ("/v1/completions", "/v1/chat/completions"):
                    assert "requestBody" in schema["paths"][path]["post"]
                assert "ChatCompletionRequest" in schema["components"]["schemas"]
                assert json.dumps(schema)  # serialisable

    run(main())


def test_operations_md_lists_every_openai_field() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    section = docs[docs.index("### The OpenAI API"):docs.index("## Metrics")]
    fields = {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields}
    assert sorted(f for f in fields if f"`{f}`" not in section) == []


def test_created_is_when_the_request_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenAI stamps an answer, and every chunk of a stream, with the request's arrival (a long
    answer's ``created`` is not its end)."""
    import scheduler.service.routes_openai as routes

    arrived = 1_000_000
    monkeypatch.setattr(routes, "now", lambda: arrived)  # the route's clock, read on arrival

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                # (Chat answers through the same route code; the reference model has no chat
                # template.)
                body = {"prompt": "when", "max_tokens": 3, "temperature": 0}
                r = await post(client, "/v1/completions", **body)
                assert r.status_code == 200, r.text
                assert r.json()["created"] == arrived
                r = await post(client, "/v1/completions", **body, stream=True,
                               stream_options={"include_usage": True})
                assert {c["created"] for c in sse(r.text)} == {arrived}

    run(main())


@pytest.mark.parametrize("role", ["both", "prefill"])
def test_max_model_len_is_what_this_server_takes(role: str) -> None:
    """``/v1/models`` advertises the longest request (prompt and answer) this worker takes: its
    KV pool's 256 tokens here, not the model's context of 8,192 positions, so a client sizing
    its requests from it is not refused; as with the context, the answer's last token needs no
    KV, so prompt + ``max_tokens`` may reach ``max_model_len`` + 1."""
    extra: dict[str, Any] = {} if role == "both" else {"bootstrap_port": free_port()}
    backend = "local" if role == "both" else "fake"

    async def main() -> None:
        with running_service(config(role, backend, **extra)) as service:
            async with asgi_client(service) as client:
                (card,) = (await client.get("/v1/models")).json()["data"]
                assert card["max_model_len"] == 64 * SCHED.page_size < MODEL.max_position
                if role != "both":
                    return
                for answer, status in ((27, 200), (28, 400)):  # 230 + 27 - 1 = 256 tokens
                    r = await post(client, "/v1/completions", prompt=[7] * 230,
                                   max_tokens=answer, temperature=0, ignore_eos=True)
                    assert r.status_code == status, r.text
                    if status == 400:
                        assert r.json()["error"]["code"] == "context_length_exceeded"
                        assert "maximum context length is 256 tokens" in r.text

    run(main())
