"""``/generate``'s sampling and logprob fields through SGLang's router (0.3.2) in front of a
pdlife prefill and decode worker over Mooncake, against the same requests to a colocated
service: seeded draws, penalties and biases, grammars, logprobs (the router merges the
prefill's input logprobs into the decode's answer, but not into a stream's chunks, nor the
input top logprobs), refusals."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from scheduler.prefill.config import SchedulerConfig
from scheduler.service.config import ServeConfig
from scheduler.service.core import Service
from tests.service_harness import asgi_client, run, running_service, tokens_of_stream, wait_for
from tests.test_router_e2e import MODEL, Cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

PROMPT = [72, 101, 108, 108, 111, 44, 32, 112, 100]
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_text_in_logprobs": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tmp_path_factory.mktemp("router")) as started:
        yield started


@pytest.fixture(scope="module")
def colocated() -> Iterator[Service]:
    config = ServeConfig(role="both", backend="local", model=MODEL,
                         scheduler=SchedulerConfig(chunked_prefill_size=64),
                         max_new_tokens_limit=4096)
    with running_service(config) as service:
        yield service


def routed(cluster: Cluster, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{cluster.url}/generate", json=body, timeout=120)


def local(service: Service, body: dict[str, Any]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with asgi_client(service) as client:
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            answer: dict[str, Any] = r.json()
            return answer
    result: dict[str, Any] = run(main())
    return result


def local_list(service: Service, body: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`local` for a body answered with a list (a batch, or n > 1)."""
    answer: Any = local(service, body)
    assert isinstance(answer, list)
    return answer


def same_logprobs(got: list[Any], want: list[Any]) -> None:
    """Equal triples (or per-position lists of them), logprobs to float precision."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w and isinstance(w[0], list):
            same_logprobs(g, w)
            continue
        assert g[1:] == w[1:]
        assert g[0] == pytest.approx(w[0], abs=1e-5) if w[0] is not None else g[0] is None


def test_seeded_draws_and_logprobs_equal_the_colocated_run(cluster: Cluster,
                                                            colocated: Service) -> None:
    body = {"input_ids": PROMPT, **LOGPROBS, "sampling_params": {
        "max_new_tokens": 8, "ignore_eos": True, "temperature": 0.9, "top_p": 0.95,
        "sampling_seed": 2026}}
    r = routed(cluster, body)
    assert r.status_code == 200, r.text
    got, want = r.json(), local(colocated, body)
    assert got["output_ids"] == want["output_ids"]
    meta, ref = got["meta_info"], want["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 8
    # The router put the prefill's input logprobs in front of the decode's (none).
    same_logprobs(meta["input_token_logprobs"], ref["input_token_logprobs"])
    same_logprobs(meta["output_token_logprobs"], ref["output_token_logprobs"])
    same_logprobs(meta["output_top_logprobs"], ref["output_top_logprobs"])
    assert meta["input_top_logprobs"] == []  # the router merges no input top logprobs
    assert routed(cluster, body).json()["output_ids"] == got["output_ids"]  # the seed repeats


def test_named_ids_logprobs_through_the_router_equal_the_colocated_run(
        cluster: Cluster, colocated: Service) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "token_ids_logprob": [101, 7, 101],
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    r = routed(cluster, body)
    assert r.status_code == 200, r.text
    meta, ref = r.json()["meta_info"], local(colocated, body)["meta_info"]
    # The first output token's named logprobs came from prefill in the metadata row.
    same_logprobs(meta["output_token_ids_logprobs"], ref["output_token_ids_logprobs"])
    assert len(meta["output_token_ids_logprobs"]) == 6
    assert meta["input_token_ids_logprobs"] == []  # the router merges only the input logprobs
    same_logprobs(meta["input_token_logprobs"], ref["input_token_logprobs"])


def test_no_new_tokens_through_the_router_scores_the_prompt_alone(cluster: Cluster,
                                                                 colocated: Service) -> None:
    body = {"input_ids": PROMPT, **LOGPROBS, "sampling_params": {"max_new_tokens": 0}}
    r = routed(cluster, body)
    assert r.status_code == 200, r.text
    got, want = r.json(), local(colocated, body)
    assert (got["text"], got["output_ids"], got["meta_info"]["completion_tokens"]) == ("", [], 0)
    assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    same_logprobs(got["meta_info"]["input_token_logprobs"],
                  want["meta_info"]["input_token_logprobs"])
    assert len(want["meta_info"]["input_token_logprobs"]) == len(PROMPT)
    assert got["meta_info"]["output_token_logprobs"] == []


def test_a_stream_through_the_router_ends_with_the_output_logprobs(cluster: Cluster,
                                                                   colocated: Service) -> None:
    body = {"input_ids": PROMPT, **LOGPROBS,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    r = routed(cluster, {**body, "stream": True})
    assert r.status_code == 200, r.text
    chunks, done = tokens_of_stream(r.text)
    assert done
    last, want = chunks[-1], local(colocated, body)
    assert last["output_ids"] == want["output_ids"]
    same_logprobs(last["meta_info"]["output_token_logprobs"],
                  want["meta_info"]["output_token_logprobs"])
    assert last["meta_info"]["input_token_logprobs"] == []  # not merged into a stream
    for chunk in chunks:  # the decode worker's chunks, passed on: the output logprobs so far
        n = len(chunk["output_ids"])
        assert chunk["meta_info"]["output_token_logprobs"] == last["meta_info"][
            "output_token_logprobs"][:n]


def test_grammars_stops_and_refusals_through_the_router(cluster: Cluster,
                                                        colocated: Service) -> None:
    regex = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "regex": "[ab]+c"}}
    r = routed(cluster, regex)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == local(colocated, regex)["output_ids"]
    assert r.json()["text"] == local(colocated, regex)["text"]
    full = local(colocated, {"input_ids": PROMPT,
                             "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
    stop = full["text"][2:4]
    stopped = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True,
                                                        "stop": [stop]}}
    r = routed(cluster, stopped)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r.json()["text"] == local(colocated, stopped)["text"]
    r = routed(cluster, {"input_ids": PROMPT,
                         "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 8}})
    assert r.status_code == 400
    assert "min_new_tokens must be at most sampling_params.max_new_tokens (4), got 8" in r.text
    # Neither worker holds anything for the refused request.
    wait_for(cluster.workers_idle, 30, "both workers idle")


def test_penalties_and_min_new_tokens_through_the_router(cluster: Cluster,
                                                         colocated: Service) -> None:
    """The decode worker applies the penalties over the output; ``min_new_tokens`` holds EOS
    back on both (the prefill worker's first token included). (The router, 0.3.2, drops
    ``logit_bias`` from ``/generate``'s sampling_params; its OpenAI routes pass it on:
    ``tests/test_openai_router_e2e.py``.)"""
    body = {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 10, "min_new_tokens": 6, "temperature": 0.8, "sampling_seed": 11,
        "frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.4}}
    r = routed(cluster, body)
    assert r.status_code == 200, r.text
    got = r.json()["output_ids"]
    assert got == local(colocated, body)["output_ids"] and len(got) >= 6
    plain = {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0.8, "sampling_seed": 11}}
    assert got != local(colocated, plain)["output_ids"]  # the penalties changed the answer


def test_without_a_sampling_seed_the_room_seeds_both_workers(cluster: Cluster) -> None:
    """Sent to the pair as the router sends it, with a room of our choosing: an unseeded draw is
    the draw of ``sampling_seed`` = room, and the prefill's first token agrees with it."""
    port = cluster.prefill.get("/server_info")["bootstrap_port"]
    draw = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0}
    room = 987654321
    body = {"input_ids": PROMPT, "sampling_params": draw, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(
            lambda url: httpx.post(f"{url}/generate", json=body, timeout=120),
            [cluster.prefill.url, cluster.decode.url]))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    prefill, decode = (a.json()["output_ids"] for a in answers)
    seeded = routed(cluster, {"input_ids": PROMPT,
                              "sampling_params": {**draw, "sampling_seed": room}})
    assert decode == seeded.json()["output_ids"]
    assert prefill == decode[:1]


def test_one_room_for_several_samples_is_spread_over_them(cluster: Cluster,
                                                          colocated: Service) -> None:
    """n > 1 as the router sends it to ``/generate`` and ``/v1/completions``: one room for the
    request (or one per prompt of a batch), which both workers spread over the samples as
    SGLang does, sample ``i`` taking ``room + i``; unseeded, each draws as ``sampling_seed`` =
    its room. Through the router, seeded samples equal the colocated ones."""
    port = cluster.prefill.get("/server_info")["bootstrap_port"]
    draw = {"max_new_tokens": 5, "ignore_eos": True, "temperature": 1.0}
    room = 987654000
    body = {"input_ids": PROMPT, "sampling_params": {**draw, "n": 2},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(
            lambda url: httpx.post(f"{url}/generate", json=body, timeout=120),
            [cluster.prefill.url, cluster.decode.url]))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    decode = [a["output_ids"] for a in answers[1].json()]
    assert decode == [routed(cluster, {"input_ids": PROMPT, "sampling_params": {
        **draw, "sampling_seed": room + i}}).json()["output_ids"] for i in range(2)]
    seeded = {"input_ids": [PROMPT, PROMPT[:4]],
              "sampling_params": {**draw, "n": 2, "sampling_seed": 5}}
    r = routed(cluster, seeded)
    assert r.status_code == 200, r.text
    assert [a["output_ids"] for a in r.json()] == [
        a["output_ids"] for a in local_list(colocated, seeded)]
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "model": "pdlife", "prompt": ["Hello, pd", "Hell"], "max_tokens": 5, "temperature": 1.0,
        "seed": 5, "ignore_eos": True, "n": 2})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    wait_for(cluster.workers_idle, 30, "both workers idle after the samples")
