"""The official ``openai`` client against SGLang's router (Rust) in front of a pdlife prefill and
a pdlife decode worker on SmolLM2, KV over Mooncake, all as processes on loopback.

Every answer is compared with the colocated run: the same request to an in-process
``pdlife serve --backend local`` on the same model (and, greedy, with the model's own
``generate``): chat and completions, plain and streamed, logprobs, a seeded draw, concurrent
clients, a JSON schema, a forced tool call. One router and pair of workers serve the whole
module; answers are short to keep it affordable on two CPU cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx2
import jsonschema
import openai
import pytest

from scheduler.prefill.config import SchedulerConfig
from scheduler.service.app import create_app
from scheduler.service.config import ServeConfig
from scheduler.service.core import Service
from tests.service_harness import running_service, wait_for
from tests.test_router_e2e import Cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

T = TypeVar("T")
SMOLLM2 = ["--model", "smollm2", "--pool-pages", "256"]
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
CAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Two processes load SmolLM2 at once on shared cores: give them time.
    with Cluster(tmp_path_factory.mktemp("openai-router"), SMOLLM2,
                 startup_timeout=240) as started:
        yield started


@pytest.fixture(scope="module")
def colocated(smollm2: Any) -> Iterator[Service]:
    config = ServeConfig(role="both", backend="local", served=smollm2, model_name="smollm2",
                         scheduler=SchedulerConfig(chunked_prefill_size=64), pool_pages=256)
    with running_service(config) as service:
        yield service


@contextlib.asynccontextmanager
async def clients(cluster: Cluster, colocated: Service
                  ) -> AsyncIterator[tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]]:
    """The router's client and the colocated service's (in process, the same HTTP library)."""
    transport = httpx2.ASGITransport(app=create_app(colocated))
    async with httpx2.AsyncClient(transport=transport, base_url="http://colocated/v1") as http:
        yield (openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0,
                                  timeout=120),
               openai.AsyncOpenAI(base_url="http://colocated/v1", api_key="none",
                                  http_client=http, max_retries=0))


def on_both(cluster: Cluster, colocated: Service,
            call: Callable[[openai.AsyncOpenAI], Awaitable[T]]) -> tuple[T, T]:
    """``call`` through the router and on the colocated service."""
    async def main() -> tuple[T, T]:
        async with clients(cluster, colocated) as (routed, local):
            return await call(routed), await call(local)

    return asyncio.run(main())


def test_chat_and_completions_equal_the_colocated_run(cluster: Cluster, colocated: Service,
                                                       smollm2: Any) -> None:
    want = smollm2.decode(smollm2.generate(smollm2.encode_messages(QUESTION), 16))
    assert want == "The capital of France is Paris."

    async def call(client: openai.AsyncOpenAI) -> list[Any]:
        chat = await client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
        streamed = await client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in streamed]
        text = await client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8,
                                               temperature=0)
        text_chunks = [c async for c in await client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)]
        usage = chunks[-1].usage
        assert chat.usage is not None and usage is not None
        return [chat.choices[0].message.content, chat.choices[0].finish_reason,
                chat.usage.completion_tokens, chat.usage.prompt_tokens,
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                usage.completion_tokens, text.choices[0].text, text.choices[0].finish_reason,
                "".join(c.choices[0].text for c in text_chunks)]

    routed, local = on_both(cluster, colocated, call)
    assert routed == local
    chat, finish, _, _, streamed, _, text, text_finish, text_streamed = routed
    assert (chat, finish, streamed) == (want, "stop", want)
    greedy = smollm2.generate(smollm2.tokenizer.encode(PROMPT), 8)
    assert text == text_streamed == smollm2.decode(greedy) and text_finish == "length"


def test_logprobs_through_the_router_equal_the_colocated_run(cluster: Cluster,
                                                             colocated: Service) -> None:
    async def call(client: openai.AsyncOpenAI) -> tuple[Any, Any]:
        chat = await client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
            top_logprobs=3)
        text = await client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6,
                                               temperature=0, logprobs=2)
        assert chat.choices[0].logprobs is not None and text.choices[0].logprobs is not None
        return chat.choices[0].logprobs.content, text.choices[0].logprobs

    (chat, text), (local_chat, local_text) = on_both(cluster, colocated, call)
    assert chat is not None and local_chat is not None and len(chat) == 6
    for got, want in zip(chat, local_chat, strict=True):
        assert (got.token, got.bytes) == (want.token, want.bytes)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert got.top_logprobs[0].logprob == pytest.approx(got.logprob, abs=1e-6)
    assert text.tokens == local_text.tokens and len(text.tokens or ()) == 6
    assert text.token_logprobs == pytest.approx(local_text.token_logprobs, abs=1e-4)


def test_penalties_a_bias_and_min_tokens_through_the_router_equal_the_colocated_run(
        cluster: Cluster, colocated: Service, smollm2: Any) -> None:
    """The router passes the OpenAI ``logit_bias`` and SGLang's ``min_tokens`` and penalties on
    to both workers: the prefill worker's first token obeys the bias (the plain answer's first
    token banned), the decode worker's answer the penalties and the minimum."""
    banned = smollm2.generate(smollm2.encode_messages(QUESTION), 1)[0]

    async def call(client: openai.AsyncOpenAI) -> list[Any]:
        chat = await client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=16, temperature=0.7, seed=3,
            logit_bias={str(banned): -100}, frequency_penalty=0.8, presence_penalty=0.3,
            extra_body={"min_tokens": 12, "repetition_penalty": 1.2})
        text = await client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0,
            frequency_penalty=1.0, extra_body={"repetition_penalty": 1.5})
        assert chat.usage is not None
        return [chat.choices[0].message.content, chat.usage.completion_tokens,
                text.choices[0].text]

    routed, local = on_both(cluster, colocated, call)
    assert routed == local
    content, tokens, _ = routed
    assert tokens >= 12
    assert smollm2.tokenizer.encode(content)[0] != banned


def test_a_seed_reproduces_through_the_router_and_equals_the_colocated_draw(
        cluster: Cluster, colocated: Service) -> None:
    async def call(client: openai.AsyncOpenAI) -> list[str]:
        answers = []
        for seed in (11, 11, 12):
            r = await client.chat.completions.create(
                model="smollm2", messages=QUESTION, max_tokens=10, temperature=1.0, seed=seed)
            answers.append(r.choices[0].message.content or "")
        return answers

    routed, local = on_both(cluster, colocated, call)
    assert routed == local
    assert routed[0] == routed[1] and routed[0] != routed[2]


def test_concurrent_clients_get_the_colocated_answers(cluster: Cluster, smollm2: Any) -> None:
    questions = ["What is the capital of France?", "Name a colour.", "What is 2 + 2?",
                 "Say hello.", "What is the largest ocean?", "Name a fruit."]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    want = [smollm2.decode(smollm2.generate(smollm2.encode_messages(p), 8)) for p in prompts]

    async def ask(client: openai.AsyncOpenAI, i: int, messages: Any) -> str:
        if i % 2:
            stream = await client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=8, temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
        r = await client.chat.completions.create(model="smollm2", messages=messages,
                                                 max_tokens=8, temperature=0)
        return r.choices[0].message.content or ""

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none",
                                    max_retries=0, timeout=120)
        return list(await asyncio.gather(*(ask(client, i, p) for i, p in enumerate(prompts))))

    assert asyncio.run(main()) == want


def test_n_choices_through_the_router_equal_the_colocated_ones(cluster: Cluster,
                                                               colocated: Service) -> None:
    # The router sends n > 1 with a bootstrap room per choice; each is its own request.
    async def call(client: openai.AsyncOpenAI) -> list[Any]:
        r = await client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=4, temperature=1.0, seed=11, n=2)
        assert r.usage is not None
        return [[(c.index, c.message.content) for c in r.choices], r.usage.completion_tokens]

    routed, local = on_both(cluster, colocated, call)
    assert routed == local
    assert [i for i, _ in routed[0]] == [0, 1]
    wait_for(cluster.workers_idle, 30, "both workers idle after the choices")


def test_a_batch_of_echoed_prompts_through_the_router_equals_the_colocated_run(
        cluster: Cluster, colocated: Service) -> None:
    prompts = [PROMPT, "Two plus two is"]

    async def call(client: openai.AsyncOpenAI) -> list[Any]:
        r = await client.completions.create(model="smollm2", prompt=prompts, max_tokens=4,
                                            temperature=0, echo=True)
        # No new token: the prompts alone.
        alone = await client.completions.create(model="smollm2", prompt=prompts, max_tokens=0,
                                                echo=True)
        assert r.usage is not None and alone.usage is not None
        return [[(c.index, c.text) for c in r.choices], r.usage.prompt_tokens,
                [(c.text, c.finish_reason) for c in alone.choices], alone.usage.completion_tokens]

    routed, local = on_both(cluster, colocated, call)
    assert routed == local
    assert [text[:len(p)] for (_, text), p in zip(routed[0], prompts, strict=True)] == prompts
    assert routed[2:] == [[(p, "length") for p in prompts], 0]
    # The prompt's logprobs are the prefill side's: the decode worker that answers says so.
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0,
                           timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="smollm2", prompt=PROMPT, echo=True, logprobs=1)
    assert "echo with logprobs needs the prompt's logprobs" in refused.value.message
    wait_for(cluster.workers_idle, 30, "both workers idle after the batch")


def test_a_json_schema_answer_validates(cluster: Cluster, colocated: Service) -> None:
    messages: Any = [{"role": "user", "content": "Describe a cat as JSON with a name and an age."}]

    async def call(client: openai.AsyncOpenAI) -> str:
        r = await client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=40, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "cat", "schema": CAT_SCHEMA}})
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content or ""

    routed, local = on_both(cluster, colocated, call)
    assert routed == local
    jsonschema.validate(json.loads(routed), CAT_SCHEMA)


def test_a_forced_tool_call_through_the_router_equals_the_colocated_one(
        cluster: Cluster, colocated: Service) -> None:
    """Both workers render the tools into the prompt; the decode worker reads the calls."""
    cat = {**CAT_SCHEMA, "properties": {"name": {"type": "string", "maxLength": 12},
                                        "age": {"type": "integer", "maximum": 30}}}
    tools: Any = [{"type": "function", "function": {"name": "describe_cat", "parameters": cat}}]
    messages: Any = [{"role": "user", "content": "Describe a cat."}]

    async def call(client: openai.AsyncOpenAI) -> list[tuple[str, str]]:
        r = await client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=60, temperature=0, tools=tools,
            tool_choice="required", parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        return [(c.function.name, c.function.arguments)  # type: ignore[union-attr]
                for c in r.choices[0].message.tool_calls or []]

    routed, local = on_both(cluster, colocated, call)
    assert routed == local and routed
    for name, arguments in routed:
        assert name == "describe_cat"
        jsonschema.validate(json.loads(arguments), cat)


def test_refusals_reach_the_client_and_leave_both_workers_idle(cluster: Cluster) -> None:
    # The router answers a worker's 4xx with an error object of its own (code
    # decode_bad_request, no param) that keeps the worker's message.
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0,
                           timeout=60)
    # The router bounds chat's n itself (1..10), before any worker sees it.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", messages=QUESTION, n=17)
    assert "n: Validation error" in refused.value.message, refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="smollm2", prompt=PROMPT,
                                  extra_body={"response_format": {"type": "xml"}})
    assert "response_format.type: Input should be" in refused.value.message, refused.value.body
    wait_for(cluster.workers_idle, 30, "both workers idle after the refusals")
