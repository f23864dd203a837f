"""``n`` > 1 (parallel samples) on ``/generate`` and the OpenAI endpoints, on the colocated
reference model: one request per sample, seeded ``seed + i``, answered as a list (``/generate``)
or as ``n`` choices with one usage (OpenAI), streamed choices carrying their index; the bodies
SGLang's router sends (a bootstrap room per sample, or one spread over the samples) on the
prefill and decode roles; the
refusals beyond the bound. Chat's ``n`` on SmolLM2 through the official client."""

from __future__ import annotations

import collections
from typing import Any

import attrs
import httpx
import pytest

from scheduler.service.config import BadRequest, ServeConfig
from scheduler.service.sampling import MAX_N, per_choice
from tests.service_harness import asgi_client, run, running_service
from tests.test_openai_api import (
    QUESTION,
    ROUTER_COMPLETION_FIELDS,
    TOKENIZER,
    chat_config,  # noqa: F401  # the module fixture chat on SmolLM2 needs
    config,
    greedy,
    openai_client,
    sse,
)

PROMPT = [72, 101, 108, 108, 111]
DRAWN: dict[str, Any] = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0}


async def generate(client: httpx.AsyncClient, **body: Any) -> Any:
    r = await client.post("/generate", json={"input_ids": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_answers_n_samples_seeded_seed_plus_i() -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                sp = {**DRAWN, "n": 3, "sampling_seed": 40}
                answers = await generate(client, rid="par", sampling_params=sp)
                assert isinstance(answers, list) and len(answers) == 3
                assert [a["meta_info"]["id"] for a in answers] == ["par_0", "par_1", "par_2"]
                samples = [a["output_ids"] for a in answers]
                assert all(len(s) == 8 for s in samples)
                assert len({tuple(s) for s in samples}) == 3, samples  # they differ
                # Sample i is the one-sample request seeded 40 + i, and the whole repeats.
                for i, sample in enumerate(samples):
                    one = await generate(client, sampling_params={**DRAWN, "sampling_seed": 40 + i})
                    assert one["output_ids"] == sample
                again = await generate(client, sampling_params=sp)
                assert [a["output_ids"] for a in again] == samples
                # Greedy n > 1 is allowed: identical samples, the model's greedy answer.
                same = await generate(client, sampling_params={
                    "max_new_tokens": 6, "ignore_eos": True, "n": 2})
                want = greedy(PROMPT, 6, ignore_eos=True)
                assert [a["output_ids"] for a in same] == [want, want]
                # A batch with n: prompt-major, each prompt's samples together.
                batch = await client.post("/generate", json={
                    "input_ids": [PROMPT, PROMPT[:3]], "rid": "b",
                    "sampling_params": {**DRAWN, "n": 2, "sampling_seed": 40}})
                assert batch.status_code == 200, batch.text
                got = batch.json()
                assert [a["meta_info"]["id"] for a in got] == ["b-0_0", "b-0_1", "b-1_0", "b-1_1"]
                assert [a["meta_info"]["prompt_tokens"] for a in got] == [5, 5, 3, 3]
                assert [a["output_ids"] for a in got[:2]] == samples[:2]

    run(main())


def test_completions_answer_n_choices_with_one_usage_plain_and_streamed() -> None:
    body = {"prompt": TOKENIZER.decode(PROMPT), "n": 3, "max_tokens": 8, "ignore_eos": True,
            "temperature": 1.0, "seed": 40}

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                samples = [a["output_ids"] for a in await generate(
                    client, sampling_params={**DRAWN, "n": 3, "sampling_seed": 40})]
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                got = r.json()
                assert [c["index"] for c in got["choices"]] == [0, 1, 2]
                assert [c["text"] for c in got["choices"]] == [
                    TOKENIZER.decode(s) for s in samples]
                assert got["usage"]["prompt_tokens"] == len(PROMPT)
                assert got["usage"]["completion_tokens"] == 24
                assert got["usage"]["total_tokens"] == len(PROMPT) + 24
                r = await client.post("/v1/completions", json={
                    **body, "stream": True, "stream_options": {"include_usage": True}})
                assert r.status_code == 200, r.text
                chunks = sse(r.text)
                texts: dict[int, str] = collections.defaultdict(str)
                finishes: dict[int, str] = {}
                for chunk in chunks[:-1]:
                    assert chunk["id"] == chunks[0]["id"]
                    (choice,) = chunk["choices"]
                    texts[choice["index"]] += choice["text"]
                    if choice["finish_reason"] is not None:
                        finishes[choice["index"]] = choice["finish_reason"]
                assert [texts[i] for i in range(3)] == [c["text"] for c in got["choices"]]
                assert finishes == {0: "length", 1: "length", 2: "length"}
                assert chunks[-1]["choices"] == []
                assert chunks[-1]["usage"] == got["usage"]

    run(main())


def test_the_router_body_with_a_room_per_sample_runs_on_prefill_and_decode() -> None:
    # SGLang's router (0.3.2) sends n > 1 with lists of bootstrap fields, one per sample, to
    # both workers; each sample is its own request with its own room, drawing seed + i.
    body = {"model": "pdlife", "prompt": TOKENIZER.decode(PROMPT), "max_tokens": 6,
            "temperature": 1.0, "seed": 9, "ignore_eos": True, "n": 2,
            **ROUTER_COMPLETION_FIELDS, "bootstrap_host": ["2.2.2.2", "2.2.2.2"],
            "bootstrap_port": [8998, 8998], "bootstrap_room": [501, 502]}
    generate_body = {"input_ids": PROMPT, "bootstrap_host": ["2.2.2.2", "2.2.2.2"],
                     "bootstrap_port": [8998, 8998], "bootstrap_room": [601, 602],
                     "sampling_params": {**DRAWN, "max_new_tokens": 6, "n": 2,
                                         "sampling_seed": 9}}

    async def main() -> None:
        samples: dict[str, list[list[int]]] = {}
        for role in ("prefill", "decode"):
            with running_service(config(role, "fake")) as service:
                async with asgi_client(service) as client:
                    r = await client.post("/generate", json=generate_body)
                    assert r.status_code == 200, r.text
                    samples[role] = [a["output_ids"] for a in r.json()]
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
                    assert [c["text"] for c in r.json()["choices"]] == [
                        TOKENIZER.decode(ids) for ids in samples[role]]
                    # A room list of neither one entry per prompt nor one per sample is
                    # refused.
                    r = await client.post("/generate", json={
                        **generate_body, "bootstrap_room": [601, 602, 603]})
                    assert r.status_code == 400, r.text
                    assert r.json()["error"]["type"] == "bad_batch"
        # The prefill answers each sample's first token, the decode the whole sample (its
        # first token drawn by the fake backend the prefill's way), each from its seed.
        assert [len(ids) for ids in samples["prefill"]] == [1, 1]
        assert [len(ids) for ids in samples["decode"]] == [6, 6]
        assert samples["prefill"][0] != samples["prefill"][1]
        assert [ids[0] for ids in samples["decode"]] == [ids[0] for ids in samples["prefill"]]
        assert samples["decode"][0][1:] != samples["decode"][1][1:]

    run(main())


def test_per_choice_spreads_a_room_and_repeats_a_host() -> None:
    assert per_choice(5, 2, 2, "bootstrap_room") == [5, 6, 7, 8]
    assert per_choice([5, 9], 2, 2, "bootstrap_room") == [5, 6, 9, 10]
    assert per_choice([5, 9, 1, 3], 2, 2, "bootstrap_room") == [5, 9, 1, 3]  # one per choice
    assert per_choice((1 << 64) - 1, 1, 2, "bootstrap_room") == [(1 << 64) - 1, 0]  # mod 2**64
    assert per_choice(["a", "b"], 2, 2, "bootstrap_host") == ["a", "a", "b", "b"]
    assert per_choice(None, 1, 3, "bootstrap_room") == [None] * 3
    # What is not a room is repeated, for the item's check to refuse.
    assert per_choice(-1, 1, 2, "bootstrap_room") == [-1, -1]
    with pytest.raises(BadRequest, match="3 entries for 2 prompts of 2 samples each"):
        per_choice([1, 2, 3], 2, 2, "bootstrap_room")


@pytest.mark.parametrize(("body", "kind", "says"), [
    ({"sampling_params": {"n": MAX_N + 1}}, "bad_sampling",
     f"sampling_params.n must be in 1..{MAX_N}, got {MAX_N + 1}"),
    ({"sampling_params": {"n": 3}}, "bad_sampling", "more than the server queues (2"),
    ({"sampling_params": {"n": 2}, "stream": True}, "bad_batch", "streaming a batch"),
    ({"input_ids": [PROMPT, PROMPT], "sampling_params": [{"n": 2}, {"n": 1}]}, "bad_batch",
     "the same sampling_params.n"),
])
def test_generate_refuses_n_beyond_the_bound(body: dict[str, Any], kind: str,
                                              says: str) -> None:
    async def main() -> None:
        with running_service(config(max_queued_requests=2)) as service:
            async with asgi_client(service) as client:
                r = await client.post("/generate", json={"input_ids": PROMPT, **body})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["type"] == kind and says in error["message"], error
                ok = await client.post("/generate", json={"input_ids": PROMPT,
                                                          "sampling_params": {"n": 2}})
                assert ok.status_code == 200 and len(ok.json()) == 2, ok.text

    run(main())


def test_chat_answers_n_choices_through_the_openai_client(
        smollm2: Any, chat_config: ServeConfig) -> None:  # noqa: F811
    async def main() -> None:
        with running_service(chat_config) as service:
            async with openai_client(service) as client:
                async def sampled() -> list[str]:
                    r = await client.chat.completions.create(
                        model="smollm2", messages=QUESTION, max_tokens=6, temperature=1.0,
                        seed=7, n=3, logprobs=True)
                    assert [c.index for c in r.choices] == [0, 1, 2]
                    tokens = [len(c.logprobs.content or []) if c.logprobs else 0
                              for c in r.choices]
                    assert r.usage is not None and r.usage.completion_tokens == sum(tokens)
                    assert r.usage.prompt_tokens == len(smollm2.encode_messages(QUESTION))
                    return [c.message.content or "" for c in r.choices]

                first = await sampled()
                assert await sampled() == first
                assert len(set(first)) > 1, first
                one = await client.chat.completions.create(
                    model="smollm2", messages=QUESTION, max_tokens=6, temperature=1.0, seed=8)
                assert one.choices[0].message.content == first[1]
                stream = await client.chat.completions.create(
                    model="smollm2", messages=QUESTION, max_tokens=6, temperature=1.0,
                    seed=7, n=3, stream=True)
                texts: dict[int, str] = collections.defaultdict(str)
                roles = set()
                async for chunk in stream:
                    for choice in chunk.choices:
                        texts[choice.index] += choice.delta.content or ""
                        if choice.delta.role:
                            roles.add(choice.index)
                assert roles == {0, 1, 2}
                assert [texts[i] for i in range(3)] == first

    run(main())


def test_n_choices_count_the_prompts_cached_tokens_once_plain_and_streamed() -> None:
    """OpenAI's ``cached_tokens`` is part of ``prompt_tokens``: a prompt's, counted once for
    its ``n`` choices (the sum over the choices exceeded the prompt)."""
    prompt = "The quick brown fox jumps over the lazy dog, " * 2
    body = {"prompt": prompt, "n": 3, "max_tokens": 2, "ignore_eos": True}

    async def main() -> None:
        cached_config = attrs.evolve(config(), scheduler=attrs.evolve(
            config().scheduler, radix_cache=True))
        with running_service(cached_config) as service:
            async with asgi_client(service) as client:
                warm = await client.post("/v1/completions", json={**body, "n": 1})
                assert warm.status_code == 200, warm.text
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert usage["prompt_tokens"] == len(prompt)
                assert 0 < cached <= usage["prompt_tokens"], usage
                # The same as one choice's: each choice of the prompt found it cached.
                one = await client.post("/v1/completions", json={**body, "n": 1})
                assert one.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
                r = await client.post("/v1/completions", json={
                    **body, "stream": True, "stream_options": {"include_usage": True}})
                assert r.status_code == 200, r.text
                assert sse(r.text)[-1]["usage"] == usage

    run(main())
