"""The HTTP service in process (ASGI transport): answers against the colocated reference, bad
input, abort, the fake host on both roles, a failing engine loop."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import warnings
from typing import Any

import attrs
import httpx
import pytest
import torch

from kv.pool import KVPool
from lifecycle import SamplingParams
from scheduler.messages import FAKE_BOOTSTRAP_HOST
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.runner import ForwardBatch
from scheduler.service.core import ServeConfig
from tests.service_harness import asgi_client, idle, run, running_service, tokens_of_stream

MODEL = ModelConfig.tiny(seed=3)
SCHED = SchedulerConfig(page_size=4, chunked_prefill_size=16, check_invariants=True)
REFERENCE = ReferenceModel(LlamaModel(MODEL))
TOKENIZER = ByteTokenizer()


def config(role: str = "both", backend: str = "local", **kw: Any) -> ServeConfig:
    return ServeConfig(role=role, backend=backend, model=MODEL, scheduler=SCHED,  # type: ignore[arg-type]
                       pool_pages=64, metadata_slots=8, max_new_tokens_limit=32,
                       max_body_bytes=4096, **kw)


def expected(prompt: list[int], n: int, stops: tuple[int, ...] = (), ignore_eos: bool = False
             ) -> list[int]:
    return REFERENCE.generate(prompt, n, stops, ignore_eos)


async def gen(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/generate", json=body)


async def settled(client: httpx.AsyncClient) -> dict[str, Any]:
    """``/server_info`` once nothing is live (the engine loop finishes releases after answers)."""
    for _ in range(2000):
        info: dict[str, Any] = (await client.get("/server_info")).json()
        if idle(info):
            return info
        await _yield()
    raise AssertionError(f"service did not settle: {info}")


async def _yield() -> None:
    import asyncio

    await asyncio.sleep(0.005)


def rejected(metrics_text: str, reason: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(f'pdlife_http_rejected_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


# -- answers --------------------------------------------------------------------------------


def test_local_answers_equal_the_reference_single_batch_and_stream() -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                text = "Hello, pdlife!"
                prompt = TOKENIZER.encode(text)
                r = await gen(client, text=text, rid="one",
                              sampling_params={"max_new_tokens": 12, "ignore_eos": True})
                assert r.status_code == 200, r.text
                body = r.json()
                want = expected(prompt, 12, ignore_eos=True)
                assert body["output_ids"] == want
                assert body["text"] == TOKENIZER.decode(want)
                meta = body["meta_info"]
                assert meta["id"] == "one"
                assert meta["finish_reason"] == {"type": "length", "length": 12}
                assert meta["prompt_tokens"] == len(prompt)
                assert meta["completion_tokens"] == 12
                assert meta["e2e_latency"] > 0

                prompts = [[1, 2, 3], list(range(40, 90)), [200] * 17]
                r = await gen(client, input_ids=prompts, sampling_params={"max_new_tokens": 5})
                assert r.status_code == 200, r.text
                answers = r.json()
                assert [a["output_ids"] for a in answers] == [expected(p, 5) for p in prompts]
                assert len({a["meta_info"]["id"] for a in answers}) == 3
                # One sampling_params per prompt of a batch.
                per_item = [{"max_new_tokens": n, "ignore_eos": True} for n in (2, 7, 4)]
                r = await gen(client, input_ids=prompts, sampling_params=per_item)
                assert r.status_code == 200, r.text
                assert [a["output_ids"] for a in r.json()] == [
                    expected(p, n, ignore_eos=True) for p, n in zip(prompts, (2, 7, 4), strict=True)
                ]

                stop = want[3]
                r = await gen(client, text=text, stream=True,
                              sampling_params={"max_new_tokens": 12, "stop_token_ids": [stop],
                                               "ignore_eos": True})
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                chunks, done = tokens_of_stream(r.text)
                assert done
                want_stop = expected(prompt, 12, (stop,), ignore_eos=True)
                assert chunks[-1]["output_ids"] == want_stop
                assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop",
                                                                     "matched": stop}
                for earlier, later in itertools.pairwise(chunks):
                    assert later["output_ids"][: len(earlier["output_ids"])] == (
                        earlier["output_ids"])
                    assert earlier["meta_info"]["finish_reason"] is None
                info = await settled(client)
                assert info["kv_pool"]["prefill"]["total_pages"] == 64

    run(main())


def test_fake_host_prefill_role_answers_the_first_token() -> None:
    async def main() -> None:
        with running_service(config("prefill", "fake")) as service:
            async with asgi_client(service) as client:
                prompt = list(range(1, 30))
                r = await gen(client, input_ids=prompt, bootstrap_host="2.2.2.2",
                              bootstrap_room=0, sampling_params={"max_new_tokens": 9})
                assert r.status_code == 200, r.text
                assert r.json()["output_ids"] == expected(prompt, 1)
                assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
                # Warm-ups share room 0: concurrent ones must not collide.
                rs = [await gen(client, input_ids=prompt, bootstrap_host="2.2.2.2",
                                bootstrap_room=0) for _ in range(3)]
                assert all(x.status_code == 200 for x in rs)
                assert (await client.get("/health_generate")).status_code == 200
                await settled(client)
                # Each bootstrapped without a decode, and counted apart as a probe.
                metrics = (await client.get("/metrics")).text
                for series in ('pdlife_transitions_total{event="bootstrapped"} 5.0',
                               "pdlife_probe_bootstraps_total 5.0"):
                    assert series in metrics.splitlines(), series

    run(main())


def test_fake_host_decode_role_computes_the_prompt_itself() -> None:
    async def main() -> None:
        with running_service(config("decode", "mooncake")) as service:
            async with asgi_client(service) as client:
                prompt = list(range(100, 137))
                r = await gen(client, input_ids=prompt, bootstrap_host="2.2.2.2",
                              bootstrap_port=8998, bootstrap_room=0,
                              sampling_params={"max_new_tokens": 7, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["output_ids"] == expected(prompt, 7, ignore_eos=True)
                assert (await client.get("/health_generate")).status_code == 200
                await settled(client)

    run(main())


# -- bad input --------------------------------------------------------------------------------


BAD_INPUTS = [
    ("malformed_json", b'{"text": "a"', "not valid JSON"),
    ("invalid_request", json.dumps({"text": 5}).encode(), "text"),
    ("invalid_request", json.dumps({"input_ids": [1, "2"]}).encode(), "input_ids"),
    ("invalid_request", json.dumps({"text": "a", "stream": "yes"}).encode(), "stream"),
    ("empty_prompt", json.dumps({"text": ""}).encode(), "empty"),
    ("empty_prompt", json.dumps({"input_ids": []}).encode(), "empty"),
    ("bad_prompt", json.dumps({"text": "a", "input_ids": [1]}).encode(), "exactly one"),
    ("bad_token_id", json.dumps({"input_ids": [1, 9999]}).encode(), "token ids"),
    ("prompt_too_long", json.dumps({"input_ids": [7] * 300}).encode(),
     "the prompt (300 tokens) and max_new_tokens (16), less the last token, need 315 tokens "
     "of KV, more than the KV pool's 256"),
    ("prompt_too_long", json.dumps({"input_ids": [7] * 240, "sampling_params": {
        "max_new_tokens": 20}}).encode(), "max_new_tokens (20), less the last token, need 259 "
     "tokens of KV"),
    ("invalid_request", json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -3}}
                                   ).encode(), "max_new_tokens"),
    ("invalid_request", json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -1}}
                                   ).encode(),
     "sampling_params.max_new_tokens: Input should be greater than or equal to 0"),
    ("invalid_request", json.dumps({"text": 5}).encode(), "text: should be one of list[str], str"),
    # A constrained member is named as its type (it was "bootstrap_port.constrained-int: ...").
    ("invalid_request", json.dumps({"text": "a", "bootstrap_port": "abc"}).encode(),
     "bootstrap_port: should be one of int, list[int]"),
    ("invalid_request", json.dumps({"text": "a", "bootstrap_port": 70000}).encode(),
     "bootstrap_port: Input should be less than or equal to 65535"),
    ("bad_max_new_tokens", json.dumps({"text": "a", "sampling_params": {
        "max_new_tokens": 10**9}}).encode(), "at most 32"),
    ("bad_batch", json.dumps({"text": ["a", "b"], "stream": True}).encode(), "stream"),
    ("bad_batch", json.dumps({"text": ["a", "b"], "rid": ["x"]}).encode(), "entries"),
    ("duplicate_rid", json.dumps({"text": ["a", "b"], "rid": ["x", "x"]}).encode(), "distinct"),
    ("bad_batch", json.dumps({"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_port": 9,
                              "bootstrap_room": [5, 5]}).encode(), "room of its own"),
    ("bad_batch", json.dumps({"text": ["a", "b"], "sampling_params": {"n": 2},
                              "bootstrap_host": "h", "bootstrap_port": 9,
                              "bootstrap_room": [5, 6, 7]}).encode(), "3 entries for 2 prompts"),
    ("bad_batch", json.dumps({"text": "a", "sampling_params": {"n": 2}, "bootstrap_host": "h",
                              "bootstrap_port": 9, "bootstrap_room": [5, 5]}).encode(),
     "distinct rooms"),
    ("bad_batch", json.dumps({"text": ["a", "b"], "sampling_params": [{}]}).encode(), "entries"),
    ("bad_batch", json.dumps({"text": "a", "sampling_params": [{}]}).encode(), "not a batch"),
    ("bad_batch", json.dumps({"text": ["a", "b"], "sampling_params": []}).encode(),
     "0 entries for 2 prompts"),  # not the defaults for both
    # NaN is no temperature (it was refused as "should be less than or equal to 100").
    ("invalid_request", b'{"text": "a", "sampling_params": {"temperature": NaN}}',
     "sampling_params.temperature: Input should be a finite number"),
    ("bad_sampling", json.dumps({"text": "a", "sampling_params": {"top_k": 1 << 40}}).encode(),
     "top_k must be -1 (no limit) or 1..2147483648, got 1099511627776"),
    ("bad_token_id", json.dumps({"text": "a", "sampling_params": {"stop_token_ids": [3, 10**20]}}
                                ).encode(), "sampling_params.stop_token_ids: token ids must be"),
    ("unsupported", json.dumps({"text": "a", "sampling_params": {"structural_tag": "{}"}}
                               ).encode(), "structural_tag"),
    # An unpaired surrogate is no text (it was a 500, and the other worker waited).
    ("invalid_request", b'{"text": "a\\ud800b"}', "unpaired surrogate"),
    ("invalid_request", b'{"text": "a", "rid": "\\udfff"}', "unpaired surrogate"),
    ("bad_grammar", json.dumps({"text": "a", "sampling_params": {
        "json_schema": "{\"items\": " * 200 + "{}" + "}" * 200}}).encode(), "nested too deeply"),
]


@pytest.mark.parametrize(("reason", "body", "says"), BAD_INPUTS,
                         ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_a_4xx_is_counted_and_leaves_nothing(reason: str, body: bytes,
                                                              says: str) -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await client.post("/generate", content=body,
                                      headers={"content-type": "application/json"})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["type"] == reason
                assert says in error["message"]
                # One plain message per field: never the other members of a union.
                assert "valid list" not in error["message"]
                metrics = (await client.get("/metrics")).text
                assert rejected(metrics, reason) == 1.0
                assert 'route="/generate",status="400"' in metrics
                await settled(client)
                # The service still works.
                ok = await gen(client, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
                assert ok.status_code == 200

    run(main())


def test_oversized_body_unknown_abort_and_non_json() -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await gen(client, input_ids=[1] * 3000)
                assert r.status_code == 413
                assert "exceeds 4096 bytes" in r.json()["error"]["message"]
                r = await client.post("/v1/completions", json={"prompt": [1] * 3000})
                assert r.status_code == 413
                assert r.json()["error"] == {
                    "message": "the request body exceeds 4096 bytes", "param": None,
                    "type": "invalid_request_error", "code": "body_too_large"}
                r = await client.post("/abort_request", json={"rid": "nobody"})
                assert r.status_code == 404
                assert r.json()["error"] == {"message": "no live request has rid 'nobody'",
                                             "type": "unknown_rid", "rid": "nobody"}
                r = await gen(client, text="a", rid="y" * 3000)  # not echoed either
                assert r.status_code == 400 and "y" * 257 not in r.text
                assert r.json()["error"]["message"] == "rid must be 1..256 characters, got 3000"
                r = await client.post("/abort_request", json={"rid": "x" * 3000})
                assert r.status_code == 400 and "x" * 257 not in r.text
                assert r.json()["error"]["message"] == "rid must be 1..256 characters, got 3000"
                r = await client.post("/generate", content=b"text=a",
                                      headers={"content-type": "text/plain"})
                assert r.status_code == 400
                assert "application/json" in r.json()["error"]["message"]
                metrics = (await client.get("/metrics")).text
                assert rejected(metrics, "body_too_large") == 2.0
                assert rejected(metrics, "unknown_rid") == 1.0
                await settled(client)

    run(main())


@pytest.mark.mooncake
def test_a_prefill_is_not_ready_until_every_rank_registered() -> None:
    """A decode peer finds no route to a prefill whose ranks have not all registered at its
    bootstrap endpoint: /health and /generate say ``starting`` until they have."""

    async def main() -> None:
        from tests.service_harness import free_port

        with running_service(config("prefill", "mooncake", bootstrap_port=free_port())
                             ) as service:
            bootstrap = service.bootstrap
            assert bootstrap is not None
            async with asgi_client(service) as client:
                assert bootstrap.registered == 1  # rank 0, as its scheduler was built
                assert (await client.get("/health")).status_code == 200
                bootstrap.expected_ranks = 2  # as a TP 2 prefill whose rank 1 is not up yet
                for r in (await client.get("/health"),
                          await gen(client, input_ids=[1], bootstrap_host="127.0.0.1",
                                    bootstrap_port=9, bootstrap_room=5)):
                    assert r.status_code == 503, r.text
                    assert r.json()["error"]["type"] == "starting", r.text
                    assert "1 of 2 prefill ranks registered" in r.text
                bootstrap.expected_ranks = 1
                assert (await client.get("/health")).status_code == 200

    run(main())


@pytest.mark.mooncake
def test_prefill_room_in_use_duplicate_rid_and_abort() -> None:
    """With no decode peer a request waits in BOOTSTRAPPING: its room and rid stay taken until
    it is aborted, and the abort answers it with finish_reason abort."""

    async def main() -> None:
        import asyncio

        from tests.service_harness import free_port

        with running_service(config("prefill", "mooncake", bootstrap_port=free_port())
                             ) as service:
            async with asgi_client(service) as client:
                info = (await client.get("/server_info")).json()
                assert info["bootstrap_port"] == service.config.bootstrap_port
                body = {"input_ids": [5, 6, 7], "bootstrap_host": "127.0.0.1",
                        "bootstrap_port": 9, "bootstrap_room": 77}
                first = asyncio.ensure_future(gen(client, rid="a", **body))
                for _ in range(2000):
                    info = (await client.get("/server_info")).json()
                    if info["requests"]["prefill"]["bootstrapping"] == 1:
                        break
                    await _yield()
                else:
                    raise AssertionError(f"request never admitted: {info}")
                again = await gen(client, rid="b", **body)
                assert again.status_code == 400
                assert "room 77 is in use" in again.json()["error"]["message"]
                dup = await gen(client, rid="a", **{**body, "bootstrap_room": 78})
                assert dup.status_code == 400
                assert dup.json()["error"]["type"] == "duplicate_rid"
                dup = await client.post("/v1/completions", json={
                    "prompt": [5, 6, 7], "rid": "a", "max_tokens": 1,
                    **{k: v for k, v in body.items() if k != "input_ids"},
                    "bootstrap_room": 79})
                assert dup.status_code == 400
                error = dup.json()["error"]
                assert (error["code"], error["param"]) == ("duplicate_rid", "rid"), error
                missing = await gen(client, input_ids=[1])
                assert missing.status_code == 400
                assert missing.json()["error"]["type"] == "missing_bootstrap"
                r = await client.post("/abort_request", json={"rid": "a"})
                assert r.status_code == 200
                assert r.json() == {"rid": "a", "aborted": 1}
                answer = await first
                assert answer.status_code == 200
                finish = answer.json()["meta_info"]["finish_reason"]
                assert finish["type"] == "abort"
                await settled(client)

    run(main())


# -- the other endpoints ----------------------------------------------------------------------


def test_info_endpoints_and_openapi() -> None:
    async def main() -> None:
        with running_service(config(model_name="tiny")) as service:
            async with asgi_client(service) as client:
                assert (await client.get("/health")).status_code == 200
                for path in ("/model_info", "/get_model_info"):
                    info = (await client.get(path)).json()
                    # What --model loaded (SGLang's --model-path), not the served name.
                    assert info["model_path"] == "reference"
                    assert info["is_generation"] is True
                models = (await client.get("/v1/models")).json()
                assert models["data"][0]["id"] == "tiny"
                a = (await client.get("/server_info")).json()
                b = (await client.get("/get_server_info")).json()
                assert a["role"] == b["role"] == "both"
                assert (a["kv_layout"], a["disaggregation_mode"]) == ("page_major", "null")
                # The reference model's fingerprint too: what a pair compares.
                assert a["model_fingerprint"] == REFERENCE.model.fingerprint
                layout = ("tp_size", "pp_size", "dp_size", "rank_processes")
                assert [a[k] for k in layout] == [1, 1, 1, 1]
                assert set(a["requests"]) == {"prefill", "decode"}
                schema = (await client.get("/openapi.json")).json()
                for path in ("/generate", "/abort_request", "/health", "/server_info",
                             "/get_server_info", "/model_info", "/v1/models", "/metrics"):
                    assert path in schema["paths"], path
                metrics = (await client.get("/metrics")).text
                assert "pdlife_kv_pool_pages 64.0" in metrics
                assert "pdlife_decode_kv_pool_pages 64.0" in metrics
                assert "pdlife_service_healthy 1.0" in metrics
                # The process's own series, descriptors among them (operations.md, Open files).
                assert re.search(r"^process_open_fds [1-9]", metrics, re.M)
                assert re.search(r"^process_max_fds [1-9]", metrics, re.M)
                # Series an alert rates are there at 0 before their first event.
                for series in ('pdlife_peer_refusals_total{direction="received"} 0.0',
                               'pdlife_decode_peer_refusals_total{direction="sent"} 0.0',
                               'pdlife_http_rejected_total{reason="overloaded"} 0.0'):
                    assert series in metrics, series
                # Prometheus' own linter (Debian's prometheus ships promtool) finds nothing.
                lint = subprocess.run(["promtool", "check", "metrics"], input=metrics,
                                      capture_output=True, text=True, check=False)
                assert (lint.returncode, lint.stdout, lint.stderr) == (0, "", "")

    run(main())


def test_service_metrics_share_a_registry_that_has_the_process_series() -> None:
    """An embedder's registry may carry the process collector already (prometheus_client's
    global one does): the service's metrics go in beside it."""
    from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

    from scheduler.service.metrics import ServiceMetrics

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    ServiceMetrics(registry)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE process_open_fds gauge") == 1
    assert "pdlife_service_healthy 1.0" in text


def test_dropped_messages_are_exported_at_zero_before_the_first() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kv.wire import DroppedMessages, WireError
    from scheduler.service.metrics import ALWAYS_DROP_REASONS, DroppedMessagesCollector

    dropped = DroppedMessages()
    registry = CollectorRegistry()
    registry.register(DroppedMessagesCollector(lambda: [("prefill", dropped)]))
    name = "pdlife_control_messages_dropped_total"
    text = generate_latest(registry).decode()
    for reason in ALWAYS_DROP_REASONS:
        assert f'{name}{{reason="{reason}",side="prefill"}} 0.0' in text, text
    dropped.record(WireError("unknown_type", "t: 'x'"))
    dropped.record(WireError("malformed", "not msgpack"))
    text = generate_latest(registry).decode()
    assert f'{name}{{reason="unknown_type",side="prefill"}} 1.0' in text
    assert f'{name}{{reason="malformed",side="prefill"}} 1.0' in text
    assert 'side="decode"' not in text  # a side without a manager yet


# -- failure ----------------------------------------------------------------------------------

POISON = 251
BREAK = 250
DEVICE = 249


class EngineLost(BaseException):
    """What no batch's error handling catches (as ``SystemExit`` from a library would not be):
    the engine loop itself fails."""


class PoisonedRunner(PagedModelRunner):
    """The model boundary failing: a batch holding token POISON raises (its batch fails, the
    loop goes on); one holding BREAK raises :class:`EngineLost`, and one holding DEVICE a device
    error, which the scheduler cannot carry on from."""

    def forward(self, batch: ForwardBatch) -> list[int]:
        if any(POISON in item.input_ids for item in batch.items):
            raise RuntimeError("device fault")
        if any(BREAK in item.input_ids for item in batch.items):
            raise EngineLost("the device is gone")
        if any(DEVICE in item.input_ids for item in batch.items):
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")
        return super().forward(batch)


def poisoned(model: LlamaModel, pool: KVPool) -> PagedModelRunner:
    return PoisonedRunner(model, pool)


def test_a_failed_forward_fails_its_request_and_the_service_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        with running_service(config(), runner_factory=poisoned) as service:
            async with asgi_client(service) as client:
                r = await gen(client, input_ids=[POISON, 2], rid="bad")
                assert r.status_code == 500
                error = r.json()["error"]
                assert error["rid"] == "bad"
                assert "device fault" in error["message"]
                assert (await client.get("/health")).status_code == 200
                assert (await gen(client, input_ids=[1, 2])).status_code == 200
                assert service.loop.alive

    with caplog.at_level("ERROR", logger="scheduler.service.core"):
        run(main())
    logged = [r.getMessage() for r in caplog.records if r.name == "scheduler.service.core"]
    assert any(m.startswith("request 'bad' failed on the") and "500 internal" in m
               and "device fault" in m for m in logged), logged


@pytest.mark.parametrize("token", [BREAK, DEVICE], ids=["engine-lost", "device-error"])
def test_a_failed_engine_loop_fails_requests_and_the_health_check(token: int) -> None:
    async def main() -> None:
        with running_service(config(), runner_factory=poisoned) as service:
            async with asgi_client(service) as client:
                head = await client.head("/health")
                assert head.status_code == 200 and head.content == b""
                with warnings.catch_warnings():  # HEAD once made FastAPI warn of a duplicate
                    warnings.simplefilter("error")
                    schema = (await client.get("/openapi.json")).json()
                assert list(schema["paths"]["/health"]) == ["get"]
                assert (await gen(client, input_ids=[1, 2])).status_code == 200
                r = await gen(client, input_ids=[token, 2], rid="bad")
                assert r.status_code == 500
                assert r.json()["error"]["rid"] == "bad"
                health = await client.get("/health")
                assert health.status_code == 503
                assert health.json()["error"]["type"] == "unhealthy"
                cause = "the device is gone" if token == BREAK else "device-side assert"
                assert cause in health.json()["error"]["message"]
                assert (await client.head("/health")).status_code == 503
                assert (await gen(client, input_ids=[1, 2])).status_code == 503
                metrics = (await client.get("/metrics")).text
                assert "pdlife_service_healthy 0.0" in metrics
                assert rejected(metrics, "unhealthy") == 1.0
                assert not service.loop.alive
                info = (await client.get("/server_info")).json()
                assert info["live_requests"] == 0
                assert set(info["requests"]) == {"prefill", "decode"}
                assert all(n == 0 for states in info["requests"].values()
                           for n in states.values()), info["requests"]
                assert "receiving" in info["requests"]["decode"]

    run(main())


def test_a_stream_closed_while_it_waits_leaves_no_task_behind() -> None:
    """The client went away while its stream waited for tokens: closing the stream cancels its
    wait on the progress queue (left pending, asyncio logs "Task was destroyed but it is
    pending!" at ERROR whenever it is collected)."""
    import asyncio
    import contextlib

    from scheduler.service import handoff
    from scheduler.service.config import Item
    from scheduler.service.pending import Pending

    async def main() -> None:
        loop = asyncio.get_running_loop()
        item = Item("r", (1, 2), SamplingParams(), "127.0.0.1", 1, 1)
        pending = Pending(item, loop, loop.create_future(), 0.0, {"decode"},
                          progress=asyncio.Queue())
        stream = handoff.new_tokens(pending)
        reader = asyncio.ensure_future(anext(stream))
        while not [t for t in asyncio.all_tasks() if t not in (reader, asyncio.current_task())]:
            await asyncio.sleep(0)  # one loop step: the reader starts its wait
        reader.cancel()  # as the server cancels a response whose client is gone
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await stream.aclose()
        await asyncio.sleep(0)  # one loop step: a cancelled task finishes
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    run(main())


def test_null_is_each_generate_fields_default() -> None:
    """SGLang's /generate fields are optional, None meaning the default: a client (or a router)
    that sends null for one gets the default, as from SGLang."""
    body = {"input_ids": [3, 1, 4, 1, 5], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    nulls = {"top_logprobs_num": None, "return_text_in_logprobs": None, "stream": None,
             "rid": None, "token_ids_logprob": None}
    null_sampling = {"temperature": None, "top_p": None, "stop": None, "n": None}

    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                plain = (await client.post("/generate", json=body)).json()
                r = await client.post("/generate", json=body | nulls | {"sampling_params": (
                    body["sampling_params"] | null_sampling)})
                assert r.status_code == 200, r.text
                assert r.json()["output_ids"] == plain["output_ids"]
                assert (r.json()["meta_info"]["input_token_logprobs"]
                        == plain["meta_info"]["input_token_logprobs"])

    run(main())


def test_a_decode_worker_contacts_only_the_prefill_servers_it_allows() -> None:
    """``--allow-prefill``: a request naming another bootstrap address is refused before the
    worker contacts it (it would send its peer token there)."""
    from scheduler.service.config import BadRequest, check_item

    allowed = ServeConfig(role="decode", backend="mooncake", model=MODEL,
                          allowed_prefills=("10.0.0.5:8998",))
    sampling = SamplingParams(4)
    fields = {"rid": "r", "input_ids": [1, 2], "sampling": sampling, "bootstrap_room": 7}
    item = check_item(allowed, itertools.count(1), bootstrap_host="10.0.0.5",
                      bootstrap_port=8998, **fields)
    assert item.bootstrap_addr == "10.0.0.5:8998"
    with pytest.raises(BadRequest, match=r"10\.0\.0\.6:8998 is not a prefill server") as refused:
        check_item(allowed, itertools.count(1), bootstrap_host="10.0.0.6", bootstrap_port=8998,
                   **fields)
    assert refused.value.reason == "bad_bootstrap"
    anyone = attrs.evolve(allowed, allowed_prefills=())
    assert check_item(anyone, itertools.count(1), bootstrap_host="10.0.0.6",
                      bootstrap_port=8998, **fields).bootstrap_host == "10.0.0.6"


@pytest.mark.mooncake
def test_a_decode_worker_tells_no_refusal_to_a_prefill_it_may_not_contact() -> None:
    """A refusal carries the peer token: refusing a request that names an address outside
    ``--allow-prefill`` posted the token to that address."""
    sent = 'pdlife_decode_peer_refusals_total{direction="sent"}'

    async def main() -> None:
        allowed = config("decode", "mooncake", allowed_prefills=("127.0.0.1:8998",))
        with running_service(allowed) as service:
            async with asgi_client(service) as client:
                elsewhere = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 32555}
                for fields in ({"input_ids": [1, 2]},  # refused for naming that address
                               {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -4}}):
                    r = await gen(client, bootstrap_room=99, **elsewhere, **fields)
                    assert r.status_code == 400, r.text
                metrics = (await client.get("/metrics")).text
                assert f"{sent} 0.0" in metrics
                # The same refusal of a request naming an allowed prefill is told to it.
                r = await gen(client, input_ids=[1, 2], bootstrap_host="127.0.0.1",
                              bootstrap_port=8998, bootstrap_room=99,
                              sampling_params={"max_new_tokens": -4})
                assert r.status_code == 400, r.text
                assert f"{sent} 1.0" in (await client.get("/metrics")).text

    run(main())


def test_a_grammar_llguidance_cannot_run_is_the_clients_400_saying_why() -> None:
    """The grammar compiles but llguidance's lexer reaches its limit on the first token: the
    request's fault (400 ``rejected``, also in a stream's OpenAI error event), said without
    llguidance's parser-state dump; the server answers the next request."""
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                r = await client.post("/generate", json={"text": "a", "sampling_params": {
                    "max_new_tokens": 2, "regex": "a{1000}{1000}"}})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["type"] == "rejected", error
                message = error["message"]
                assert "grammar engine cannot run" in message, message
                assert "too many expressions" in message and "<state>" not in message, message
                assert "\n" not in message
                r = await client.post("/v1/completions", json={
                    "prompt": "a", "max_tokens": 2, "regex": "a{1000}{1000}", "stream": True})
                events = [json.loads(line.removeprefix("data: "))
                          for line in r.text.splitlines() if line.startswith("data: {")]
                assert [e["error"]["type"] for e in events] == ["invalid_request_error"], events
                assert events[0]["error"]["code"] == "rejected"
                r = await client.post("/generate", json={"text": "a", "sampling_params": {
                    "max_new_tokens": 2, "regex": "a{2}"}})
                assert r.status_code == 200 and r.json()["text"] == "aa", r.text

    run(main())


def compiles(metrics_text: str) -> dict[str, float]:
    found = re.findall(r'^pdlife_grammar_compiles_total\{result="(\w+)"\} (\S+)$', metrics_text,
                       re.MULTILINE)
    return {result: float(n) for result, n in found}


def test_a_decode_worker_compiles_a_fake_host_grammar_ahead_for_both_of_its_draws() -> None:
    """On the fake host a decode worker draws the first token itself, the prefill's way, then
    decodes: both matchers are compiled at admission, none on the engine thread."""
    async def main() -> None:
        with running_service(config("decode", "mooncake")) as service:
            async with asgi_client(service) as client:
                r = await client.post("/generate", json={
                    "text": "a", "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": 1,
                    "bootstrap_room": 0, "sampling_params": {
                        "max_new_tokens": 4, "regex": "(ab|c)+"}})
                assert r.status_code == 200, r.text
                assert re.fullmatch("(ab|c)+", r.json()["text"]), r.text
                await settled(client)
                assert compiles((await client.get("/metrics")).text) == {
                    "prepared": 2, "inline": 0, "refused": 0}

    run(main())


def test_admission_compiles_a_grammar_for_each_engine_and_the_engines_compile_none() -> None:
    """A colocated worker compiles a request's grammar off the engine thread, one matcher for
    its prefill engine and one for its decode engine; a grammar naming a special token the
    vocabulary lacks is refused at admission, before any engine sees it."""
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                assert compiles((await client.get("/metrics")).text) == {
                    "prepared": 0, "inline": 0, "refused": 0}
                for _ in range(2):
                    r = await client.post("/generate", json={"text": "a", "sampling_params": {
                        "max_new_tokens": 4, "regex": "(ab|c)+"}})
                    assert r.status_code == 200, r.text
                    assert re.fullmatch("(ab|c)+", r.json()["text"]), r.text
                await settled(client)
                assert compiles((await client.get("/metrics")).text) == {
                    "prepared": 4, "inline": 0, "refused": 0}
                r = await client.post("/generate", json={"text": "a", "sampling_params": {
                    "max_new_tokens": 4, "regex": "(ab|c)+", "n": 3, "temperature": 1.0}})
                assert r.status_code == 200, r.text
                assert all(re.fullmatch("(ab|c)+", a["text"]) for a in r.json()), r.text
                await settled(client)  # the samples' grammar is checked once, compiled for each
                assert compiles((await client.get("/metrics")).text) == {
                    "prepared": 10, "inline": 0, "refused": 0}
                r = await client.post("/generate", json={"text": "a", "sampling_params": {
                    "max_new_tokens": 4, "ebnf": 'start: "a" <|no_such_token|>'}})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["type"] == "bad_grammar", error
                assert "sampling_params.ebnf does not compile" in error["message"], error
                assert "unknown special token" in error["message"], error
                assert compiles((await client.get("/metrics")).text) == {
                    "prepared": 10, "inline": 0, "refused": 1}

    run(main())


def test_a_log_line_names_at_most_eight_rids() -> None:
    from scheduler.service.config import Item
    from scheduler.service.handoff import shown_rids

    items = [Item(f"r{i}", (1, 2), SamplingParams(), "127.0.0.1", 1, 1 + i)
             for i in range(100_000)]
    assert shown_rids(items[:2]) == "['r0', 'r1']"
    assert shown_rids(items) == f"{[f'r{i}' for i in range(8)]} and 99992 more"
