"""A worker's limits as its refusals say them: a request beyond the context or the KV pool (its
numbers are the client's, ``param`` the field to change), on every role; the reference model
in process, SmolLM2 where chat's template is needed."""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import pytest

from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.config import ServeConfig
from tests.service_harness import asgi_client, free_port, run, running_service

MODEL = ModelConfig.tiny(seed=5)
PAGE = 4
POOL_PAGES = 64  # 256 tokens of KV


def config(role: str = "both", model: ModelConfig = MODEL, **kw: Any) -> ServeConfig:
    backend = "local" if role == "both" else "fake"
    return ServeConfig(
        role=role, backend=backend, model=model,  # type: ignore[arg-type]
        scheduler=SchedulerConfig(page_size=PAGE, chunked_prefill_size=64),
        pool_pages=POOL_PAGES, metadata_slots=8, max_new_tokens_limit=32,
        bootstrap_port=free_port(), **kw)


async def refusal(client: httpx.AsyncClient, path: str, **body: Any) -> dict[str, Any]:
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_context_refusal_counts_the_completion_the_client_asked_for(role: str) -> None:
    """A prefill's pool holds the prompt alone, yet the refusal counts ``max_tokens`` as sent,
    as a decode's does (it said 0 on a prefill): the numbers are the client's."""
    async def main() -> None:
        with running_service(config(role)) as service:
            async with asgi_client(service) as client:
                for asked in (4, 0):  # completions' 0 asks for the prompt alone
                    error = await refusal(client, "/v1/completions", prompt=[7] * 300,
                                          max_tokens=asked)
                    assert error["code"] == "context_length_exceeded", error
                    assert error["message"].startswith(
                        "This server's (its KV pool's) maximum context length is 256 tokens. "
                        f"However, you requested {300 + asked} tokens (300 in the prompt, "
                        f"{asked} in the completion). Please reduce the length of the prompt "
                        "or max_tokens."), error

    run(main())


def test_param_blames_max_tokens_where_the_prompt_alone_fits() -> None:
    """``param`` is ``max_tokens`` where the same prompt with ``max_tokens`` 1 is served, as a
    prompt that fills the pool exactly is (it blamed the prompt), and the prompt where it
    would not be."""
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await client.post("/v1/completions", json={"prompt": [7] * 256,
                                                               "max_tokens": 1})
                assert r.status_code == 200, r.text
                error = await refusal(client, "/v1/completions", prompt=[7] * 256, max_tokens=2)
                assert (error["code"], error["param"]) == ("context_length_exceeded",
                                                           "max_tokens"), error
                error = await refusal(client, "/v1/completions", prompt=[7] * 257, max_tokens=1)
                assert error["param"] == "prompt", error

    run(main())


def test_a_request_beyond_both_limits_is_told_the_smaller_and_blames_the_prompt() -> None:
    """A context of 300 positions over a pool of 256 tokens: 280 + 30 - 1 overruns both, and
    the refusal names the pool's 256, what this server can take (it named the model's 300);
    280 tokens overrun the pool whatever ``max_tokens`` is, so the prompt is the field to
    change (it blamed ``max_tokens``)."""
    async def main() -> None:
        with running_service(config(model=attrs.evolve(MODEL, max_position=300))) as service:
            async with asgi_client(service) as client:
                error = await refusal(client, "/v1/completions", prompt=[7] * 280,
                                      max_tokens=30)
                assert error["message"].startswith("This server's (its KV pool's) maximum "
                                                   "context length is 256 tokens."), error
                assert error["param"] == "prompt", error
                error = await refusal(client, "/v1/completions", prompt=[7] * 250,
                                      max_tokens=30)
                assert error["param"] == "max_tokens", error

    run(main())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_param_names_what_a_worker_role_holds(role: str) -> None:
    """A prefill's pool holds the prompt alone: ``max_tokens`` can never be what it refuses
    for; a decode's holds the answer too."""
    async def main() -> None:
        with running_service(config(role)) as service:
            async with asgi_client(service) as client:
                error = await refusal(client, "/v1/completions", prompt=[7] * 257, max_tokens=1)
                assert error["param"] == "prompt", error
                if role == "decode":
                    error = await refusal(client, "/v1/completions", prompt=[7] * 256,
                                          max_tokens=2)
                    assert error["param"] == "max_tokens", error
                else:
                    r = await client.post("/v1/completions", json={"prompt": [7] * 256,
                                                                   "max_tokens": 2})
                    assert r.status_code == 200, r.text

    run(main())


# -- chat on SmolLM2 ------------------------------------------------------------------------------


LONG_CHAT = [{"role": "user", "content": "hello " * 600}]  # 631 tokens in SmolLM2's template


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_chat_refusal_names_the_field_and_the_count_the_client_sent(smollm2: Any,
                                                                      role: str) -> None:
    """``max_tokens`` or ``max_completion_tokens``, whichever was sent, with its value; 1 when
    neither was (the one token every answer has), not the default a prefill worker computes
    for a context its pool does not limit."""
    chat = ServeConfig(role=role, backend="fake", served=smollm2,  # type: ignore[arg-type]
                       model_name="smollm2", bootstrap_port=free_port(),
                       scheduler=SchedulerConfig(page_size=16, chunked_prefill_size=64),
                       pool_pages=32, metadata_slots=8)  # 512 tokens of KV

    async def main() -> None:
        with running_service(chat) as service:
            async with asgi_client(service) as client:
                for field, asked in (("max_tokens", 4), ("max_completion_tokens", 4),
                                     (None, 1)):
                    body: dict[str, Any] = {"messages": LONG_CHAT}
                    if field is not None:
                        body[field] = asked
                    error = await refusal(client, "/v1/chat/completions", **body)
                    assert (error["code"], error["param"]) == ("context_length_exceeded",
                                                               "messages"), error
                    assert error["message"].startswith(
                        "This server's (its KV pool's) maximum context length is 512 tokens. "
                        f"However, you requested {631 + asked} tokens (631 in the messages, "
                        f"{asked} in the completion). Please reduce the length of the "
                        f"messages or {field or 'max_tokens'}."), error

    run(main())


# -- requests beyond the queue bound --------------------------------------------------------------


@pytest.mark.parametrize(("body", "kind", "says"), [
    ({"input_ids": [[7] * 4] * 3}, "bad_batch",
     "a batch of 3 prompts is 3 requests, more than the server queues (2, "
     "--max-queued-requests): send at most 2 prompts per request"),
    ({"input_ids": [[7] * 4] * 3, "sampling_params": {"n": 2}}, "bad_batch",
     "a batch of 3 prompts of sampling_params.n=2 samples each is 6 requests, more than the "
     "server queues (4, --max-queued-requests): send at most 2 prompts per request"),
    ({"input_ids": [[7] * 4] * 2, "sampling_params": {"n": 5}}, "bad_sampling",
     "sampling_params.n=5 asks for 5 requests per prompt (10 for a batch of 2 prompts), more "
     "than the server queues (4, --max-queued-requests)"),
    ({"input_ids": [7] * 4, "sampling_params": {"n": 5}}, "bad_sampling",
     "sampling_params.n=5 asks for 5 requests per prompt, more than the server queues (4, "
     "--max-queued-requests)"),
])
def test_a_generate_request_beyond_the_queue_bound_blames_what_is_too_large(
        body: dict[str, Any], kind: str, says: str) -> None:
    """A batch of prompts too large for the bound is the batch's fault (it blamed ``n``, which
    was 1); ``n`` is to blame where it alone is beyond the bound, or the prompt is one."""
    limit = 2 if "sampling_params" not in body else 4

    async def main() -> None:
        with running_service(config(max_queued_requests=limit)) as service:
            async with asgi_client(service) as client:
                r = await client.post("/generate", json=body)
                assert r.status_code == 400, r.text
                assert r.json()["error"] | {"rid": None} == {
                    "type": kind, "message": says, "rid": None}, r.text

    run(main())


def test_a_completions_batch_beyond_the_queue_bound_blames_the_prompt() -> None:
    async def main() -> None:
        with running_service(config(max_queued_requests=4)) as service:
            async with asgi_client(service) as client:
                error = await refusal(client, "/v1/completions", prompt=[[7] * 4] * 5,
                                      max_tokens=1)
                assert (error["code"], error["param"]) == ("bad_batch", "prompt"), error
                assert error["message"].startswith("a batch of 5 prompts is 5 requests"), error
                error = await refusal(client, "/v1/completions", prompt=[[7] * 4] * 3,
                                      max_tokens=1, n=2)
                assert (error["code"], error["param"]) == ("bad_batch", "prompt"), error
                assert error["message"].startswith(
                    "a batch of 3 prompts of n=2 samples each is 6 requests"), error
                error = await refusal(client, "/v1/completions", prompt=[7] * 4,
                                      max_tokens=1, n=5)
                assert (error["code"], error["param"]) == ("bad_sampling", "n"), error
                assert error["message"].startswith("n=5 asks for 5 requests per prompt"), error
                r = await client.post("/v1/completions", json={
                    "prompt": [[7] * 4] * 2, "max_tokens": 1, "n": 2})
                assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text

    run(main())
