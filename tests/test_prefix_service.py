"""The prefix cache behind the HTTP service: ``meta_info.cached_tokens`` (read back on the decode
side from the metadata row), ``/server_info`` and ``/metrics``, and ``--disable-radix-cache``."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import httpx

from scheduler.cli.main import build_parser
from scheduler.cli.serve import serve_config
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import ServeConfig
from tests.service_harness import (
    asgi_client,
    free_port,
    idle,
    run,
    running_service,
    tokens_of_stream,
)

MODEL = ModelConfig.tiny(seed=3)
REFERENCE = ReferenceModel(LlamaModel(MODEL))
SCHED = SchedulerConfig(page_size=4, chunked_prefill_size=16, radix_cache=True,
                        check_invariants=True)
SYSTEM = list(range(30, 70))  # 40 tokens: 10 whole pages


async def _answer(client: httpx.AsyncClient, rid: str, prompt: list[int]) -> dict[str, Any]:
    r = await client.post("/generate", json={"input_ids": prompt, "rid": rid,
                                             "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_cached_tokens_reach_the_client_and_outputs_stay_the_reference() -> None:
    async def main() -> None:
        config = ServeConfig(role="both", backend="local", model=MODEL,  # type: ignore[arg-type]
                             scheduler=SCHED, pool_pages=64, metadata_slots=8,
                             max_new_tokens_limit=32, max_body_bytes=4096)
        with running_service(config) as service:
            async with asgi_client(service) as client:
                first = await _answer(client, "a", [*SYSTEM, 1, 2])
                second = await _answer(client, "b", [*SYSTEM, 3, 4, 5])
                assert first["meta_info"]["cached_tokens"] == 0
                assert second["meta_info"]["cached_tokens"] == 40
                for body, prompt in ((first, [*SYSTEM, 1, 2]), (second, [*SYSTEM, 3, 4, 5])):
                    assert body["output_ids"] == REFERENCE.generate(prompt, 4)
                for _ in range(2000):
                    info: dict[str, Any] = (await client.get("/server_info")).json()
                    if idle(info):  # cached pages nobody locks count as free
                        break
                assert idle(info), info
                assert info["kv_pool"]["prefill"]["prefix_cache_pages"] == 10
                metrics = (await client.get("/metrics")).text
                assert "pdlife_prefix_cache_hit_tokens_total 40.0" in metrics
                # A stream says what was cached from its first chunk on, not only in its last.
                r = await client.post("/generate", json={
                    "input_ids": [*SYSTEM, 6], "rid": "c", "stream": True,
                    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
                chunks, done = tokens_of_stream(r.text)
                assert done and len(chunks) > 1
                assert [c["meta_info"]["cached_tokens"] for c in chunks] == [40] * len(chunks)

    run(main())


def test_serve_turns_the_cache_on_unless_disabled() -> None:
    parser = build_parser("serve")
    on = serve_config(parser.parse_args(["serve", "--backend", "local"]))
    off = serve_config(parser.parse_args(["serve", "--backend", "local",
                                          "--disable-radix-cache"]))
    lpm = serve_config(parser.parse_args(["serve", "--backend", "local",
                                          "--schedule-policy", "lpm"]))
    assert (on.scheduler.radix_cache, off.scheduler.radix_cache) == (True, False)
    assert lpm.scheduler.schedule_policy == "lpm"


def _config(role: str, backend: str, cache: bool = True, **kw: Any) -> ServeConfig:
    return ServeConfig(role=role, backend=backend, model=MODEL,  # type: ignore[arg-type]
                       scheduler=attrs.evolve(SCHED, radix_cache=cache), pool_pages=64,
                       metadata_slots=8, max_new_tokens_limit=32, max_body_bytes=4096, **kw)


def test_flush_cache_empties_the_cache_when_idle_as_sglang_does() -> None:
    async def main() -> None:
        with running_service(_config("both", "local")) as service:
            async with asgi_client(service) as client:
                await _answer(client, "a", [*SYSTEM, 1, 2])
                for _ in range(2000):
                    info: dict[str, Any] = (await client.get("/server_info")).json()
                    if idle(info):
                        break
                assert info["kv_pool"]["prefill"]["prefix_cache_pages"] == 10
                for method in ("POST", "GET"):  # SGLang's route takes both
                    r = await client.request(method, "/flush_cache")
                    assert r.status_code == 200, r.text
                    assert r.headers["content-type"].startswith("text/plain")
                    pages = 10 if method == "POST" else 0
                    assert r.text == f"Cache flushed: {pages} pages back in the KV pool.\n"
                info = (await client.get("/server_info")).json()
                assert info["kv_pool"]["prefill"]["prefix_cache_pages"] == 0
                again = await _answer(client, "b", [*SYSTEM, 1, 2])
                assert again["meta_info"]["cached_tokens"] == 0  # computed cold
                assert again["output_ids"] == REFERENCE.generate([*SYSTEM, 1, 2], 4)

    run(main())


def test_flush_cache_is_refused_while_a_request_is_live() -> None:
    """A prefill with no decode peer keeps its request bootstrapping: the flush waits for no
    one and says why it did nothing (SGLang answers 400 too)."""

    async def main() -> None:
        with running_service(_config("prefill", "mooncake", bootstrap_port=free_port())
                             ) as service:
            async with asgi_client(service) as client:
                waiting = asyncio.ensure_future(client.post("/generate", json={
                    "input_ids": [5, 6, 7], "rid": "w", "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": 9, "bootstrap_room": 77}))
                for _ in range(2000):
                    info = (await client.get("/server_info")).json()
                    if info["requests"]["prefill"]["bootstrapping"] == 1:
                        break
                    await asyncio.sleep(0)
                r = await client.post("/flush_cache")
                assert r.status_code == 400
                assert r.text == ("Cache not flushed: 1 request is live (or ended with its "
                                  "KV transfer still running); flush it when the server is "
                                  "idle.\n")
                assert (await client.post("/abort_request", json={"rid": "w"})).status_code == 200
                assert (await waiting).status_code == 200
                r = await client.post("/flush_cache")
                assert (r.status_code, r.text) == (
                    200, "Cache flushed: 0 pages back in the KV pool.\n")

    run(main())


def test_flush_cache_where_there_is_no_cache() -> None:
    async def main() -> None:
        for config, says in (
            (_config("decode", "fake"), "No prefix cache on this worker (a decode worker "
                                          "keeps none).\n"),
            (_config("both", "local", cache=False), "The prefix cache is off "
                                                    "(--disable-radix-cache): nothing to "
                                                    "flush.\n"),
        ):
            with running_service(config) as service:
                async with asgi_client(service) as client:
                    r = await client.post("/flush_cache")
                    assert (r.status_code, r.text) == (200, says)

    run(main())
