"""``/abort_request`` with the rid the client sent reaches every request it spawned: the samples
of ``n`` > 1 (``<rid>_<i>``, chat's too, whose answer's id is the rid) and the items of a batch
(``<rid>-<k>``), recorded when they start, not matched by prefix (``r1`` aborts none of
``r10``'s samples); an unknown rid is still 404.

The decode steps wait behind a gate (:class:`~tests.test_stream_logprobs.Gate`, closed) until
the aborts are in, so no request can end before its abort; then it opens.
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import httpx

from scheduler.model.reference import PagedModelRunner
from tests.service_harness import asgi_client, run
from tests.test_stream_logprobs import CONFIG, Gate, paced_service

#: How long a test waits for the requests it sent to be live.
LIVE_TIMEOUT_S = 60.0
BODY = {"sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}


async def _live(client: httpx.AsyncClient, count: int,
                sent: list[asyncio.Future[httpx.Response]] = ()) -> None:  # type: ignore[assignment]
    """Wait until ``count`` requests are live (none of ``sent`` answered before)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LIVE_TIMEOUT_S
    while (live := (await client.get("/server_info")).json()["live_requests"]) != count:
        answered = [f.result().text for f in sent if f.done()]
        assert not answered, answered
        assert loop.time() < deadline, f"{live} requests live, not {count}"
        await asyncio.sleep(0)  # a turn for the handlers: no time is waited for


def _opened(gate: Gate) -> None:
    gate.open = True
    gate.give()  # the step waiting on it


def _finishes(answer: httpx.Response) -> list[str]:
    body: Any = answer.json()
    assert answer.status_code == 200, answer.text
    if "choices" in body:
        return [c["finish_reason"] for c in body["choices"]]
    return [a["meta_info"]["finish_reason"]["type"]
            for a in (body if isinstance(body, list) else [body])]


def _aborts(requests: list[tuple[str, dict[str, Any]]], live: int,
            aborts: list[tuple[str, int]], served: Any = None) -> list[list[str]]:
    """Send ``requests`` (path, body), wait until ``live`` requests are, send ``aborts`` (rid,
    the number each answers aborted; 0 for a 404), open the gate: each request's finishes.
    ``served``: a real model to serve, else the reference model."""
    config = attrs.evolve(CONFIG, max_new_tokens_limit=None)
    runner: Any = PagedModelRunner
    if served is not None:
        config = attrs.evolve(config, served=served, model_name="smollm2")
        runner = served.runner

    async def main() -> list[list[str]]:
        with paced_service(config, runner, permits=0) as (service, gate):
            async with asgi_client(service) as client:
                sent = [asyncio.ensure_future(client.post(path, json=body))
                        for path, body in requests]
                try:
                    await _live(client, live, sent)
                    for rid, aborted in aborts:
                        answer = await client.post("/abort_request", json={"rid": rid})
                        if aborted:
                            assert answer.status_code == 200, (rid, answer.text)
                            assert answer.json() == {"rid": rid, "aborted": aborted}
                        else:
                            assert answer.status_code == 404, (rid, answer.text)
                            assert answer.json()["error"]["type"] == "unknown_rid"
                finally:
                    _opened(gate)
                finishes = [_finishes(await answer) for answer in sent]
                await _live(client, 0)
                # Their records went with them: the rid is unknown again.
                for rid, _ in aborts:
                    gone = await client.post("/abort_request", json={"rid": rid})
                    assert gone.status_code == 404, (rid, gone.text)
        return finishes

    finishes: list[list[str]] = run(main())
    return finishes


def test_the_rid_of_a_generate_with_n_samples_aborts_them_all() -> None:
    body = {**BODY, "text": "Tell a story", "rid": "nn",
            "sampling_params": {**BODY["sampling_params"], "n": 2, "temperature": 0.7}}
    assert _aborts([("/generate", body)], 2, [("nn", 2)]) == [["abort", "abort"]]


def test_the_rid_of_a_batch_aborts_its_items() -> None:
    body = {**BODY, "text": ["a", "b", "c"], "rid": "bb"}
    assert _aborts([("/generate", body)], 3, [("bb", 3)]) == [["abort"] * 3]


def test_a_batch_of_samples_aborts_by_its_rid_or_by_an_items() -> None:
    body = {**BODY, "text": ["a", "b"], "rid": "bn",
            "sampling_params": {**BODY["sampling_params"], "n": 2, "temperature": 0.7}}
    assert _aborts([("/generate", body)], 4, [("bn", 4)]) == [["abort"] * 4]
    # An item's rid aborts its samples alone.
    finishes = _aborts([("/generate", body)], 4, [("bn-1", 2)])
    assert finishes == [["length", "length", "abort", "abort"]]


def test_the_rid_of_a_chat_completion_with_n_choices_aborts_them_all(smollm2: Any) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "rid": "cc",
            "max_tokens": 6, "n": 2, "temperature": 0.7, "ignore_eos": True}
    assert _aborts([("/v1/chat/completions", body)], 2, [("cc", 2)],
                   served=smollm2) == [["abort", "abort"]]


def test_r1_aborts_its_samples_and_none_of_r10s() -> None:
    r1 = {**BODY, "text": "one", "rid": "r1",
          "sampling_params": {**BODY["sampling_params"], "n": 2, "temperature": 0.7}}
    r10 = {**r1, "rid": "r10"}
    finishes = _aborts([("/generate", r1), ("/generate", r10)], 4, [("r1", 2)])
    assert finishes == [["abort", "abort"], ["length", "length"]]


def test_an_unknown_rid_is_404_and_a_lone_request_aborts_as_before() -> None:
    lone = {**BODY, "text": "one", "rid": "solo"}
    finishes = _aborts([("/generate", lone)], 1, [("sol", 0), ("solo_0", 0), ("solo", 1)])
    assert finishes == [["abort"]]
