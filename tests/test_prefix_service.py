"""The prefix cache behind the HTTP service: ``meta_info.cached_tokens`` (read back on the decode
side from the metadata row), ``/server_info`` and ``/metrics``, and ``--disable-radix-cache``."""

from __future__ import annotations

from typing import Any

import httpx

from scheduler.cli.main import build_parser
from scheduler.cli.serve import serve_config
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.core import ServeConfig
from tests.service_harness import asgi_client, idle, run, running_service, tokens_of_stream

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
