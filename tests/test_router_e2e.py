"""SGLang's router in front of a pdlife prefill worker and a pdlife decode worker, KV over
Mooncake, all as processes on loopback.

64 concurrent requests (half streamed) must equal the colocated reference token for token; then
long requests are aborted mid-flight (by rid on both workers, and by a client that goes away);
both workers stay healthy and their pools return to empty.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from scheduler.cli.credentials import API_KEY_ENV
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from tests.service_harness import (
    Process,
    Server,
    free_port,
    idle,
    model_flags,
    tokens_of_stream,
    wait_for,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

# The tiny shape keeps the exact-arithmetic reference affordable on two CPU cores.
MODEL = ModelConfig.tiny()
MODEL_FLAGS = model_flags(MODEL)
REFERENCE = ReferenceModel(LlamaModel(MODEL))
LONG_NEW_TOKENS = 3000
P = TypeVar("P", bound=Process)


def workload() -> list[tuple[list[int], int]]:
    rng = random.Random(7)
    return [([rng.randrange(256) for _ in range(rng.randrange(1, 48))], rng.randrange(1, 12))
            for _ in range(64)]


def references(cases: list[tuple[list[int], int]]) -> list[list[int]]:
    return [REFERENCE.generate(p, n, (), i % 3 == 0) for i, (p, n) in enumerate(cases)]


class Cluster:
    """Router, prefill and decode processes; :meth:`stop` ends whichever were started. Both
    workers serve the model ``model_flags`` name (the tiny reference model unless said), and get
    ``startup_timeout`` seconds to turn healthy. With ``api_key`` all three require it: the
    router takes SGLang's flag and passes the key on, the prefill takes the flag, the decode the
    environment; :attr:`headers` carry it."""

    def __init__(self, tmp: Path, model_flags: Sequence[str] = tuple(MODEL_FLAGS), *,
                 startup_timeout: float = 60.0, api_key: str | None = None) -> None:
        self.tmp = tmp
        self.model_flags = list(model_flags)
        self.startup_timeout = startup_timeout  # seconds for a worker to load and turn healthy
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.procs: list[Process] = []

    def start(self) -> None:
        tmp = self.tmp
        bootstrap = free_port()
        common = ["--backend", "mooncake", "--chunked-prefill-size", "64",
                  "--max-new-tokens-limit", "4096", *self.model_flags]
        key_flag = ["--api-key", self.api_key] if self.api_key else []
        self.prefill = self._add(Server(tmp / "prefill.log", "--role", "prefill",
                                        "--bootstrap-port", str(bootstrap), *key_flag, *common))
        self.decode = self._add(Server(tmp / "decode.log", "--role", "decode", *common,
                                       env={API_KEY_ENV: self.api_key} if self.api_key else None))
        self.prefill.wait_healthy(self.startup_timeout)
        self.decode.wait_healthy(self.startup_timeout)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.router = self._add(Process([
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", self.prefill.url, str(bootstrap), "--decode", self.decode.url,
            "--host", "127.0.0.1", "--port", str(self.port), *key_flag,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", "round_robin", "--worker-startup-check-interval", "1",
            "--disable-retries", "--disable-circuit-breaker", "--log-level", "warn",
        ], tmp / "router.log"))
        wait_for(self._routes, 60, "router serving /generate")

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _add(self, proc: P) -> P:
        self.procs.append(proc)
        return proc

    def _routes(self) -> bool:
        self.router.check_alive("sglang router")
        try:
            r = httpx.post(f"{self.url}/generate", headers=self.headers, timeout=10,
                           json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        except httpx.TransportError:
            return False
        return r.status_code == 200

    def workers_idle(self) -> bool:
        return all(idle(s.get("/server_info")) for s in (self.prefill, self.decode))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


async def one(client: httpx.AsyncClient, url: str, i: int, prompt: list[int], n: int
              ) -> list[int]:
    body = {"input_ids": prompt, "rid": f"req-{i}",
            "sampling_params": {"max_new_tokens": n, "ignore_eos": i % 3 == 0}}
    if i % 2:
        r = await client.post(f"{url}/generate", json={**body, "stream": True})
        assert r.status_code == 200, r.text
        chunks, done = tokens_of_stream(r.text)
        assert done, r.text
        last = chunks[-1]
    else:
        r = await client.post(f"{url}/generate", json=body)
        assert r.status_code == 200, r.text
        last = r.json()
    assert last["meta_info"]["id"] == f"req-{i}"
    assert last["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    ids: list[int] = last["output_ids"]
    return ids


async def concurrent(url: str, cases: list[tuple[list[int], int]], want: list[list[int]]
                     ) -> None:
    limits = httpx.Limits(max_connections=128)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        got = await asyncio.gather(*(one(client, url, i, p, n) for i, (p, n) in enumerate(cases)))
    for i, (ids, expected) in enumerate(zip(got, want, strict=True)):
        assert ids == expected, f"request {i}: prompt {cases[i][0]}"


async def aborted(cluster: Cluster) -> None:
    prompt = [random.Random(i).randrange(256) for i in range(300)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": LONG_NEW_TOKENS,
                                                     "ignore_eos": True}}
    async with httpx.AsyncClient(timeout=120) as client:
        # By rid, on both workers, as SGLang's abort test does.
        rids = [f"long-{i}" for i in range(3)]
        calls = [asyncio.ensure_future(client.post(
            f"{cluster.url}/generate", json={**body, "rid": rid, "stream": rid == "long-2"}))
            for rid in rids]
        for rid in rids:
            while True:
                d = await client.post(f"{cluster.decode.url}/abort_request", json={"rid": rid})
                if d.status_code == 200:
                    break
                assert d.status_code == 404, d.text
                await asyncio.sleep(0.02)
            p = await client.post(f"{cluster.prefill.url}/abort_request", json={"rid": rid})
            assert p.status_code in (200, 404), p.text
        for rid, call in zip(rids, calls, strict=True):
            r = await call
            if r.status_code != 200:
                # The prefill side learnt of the abort from decode first and failed the
                # transfer; the router returns prefill's error (SGLang's abort test allows it).
                assert r.status_code in (500, 503) and "abort" in r.text, r.text
                continue
            if rid == "long-2":
                chunks, done = tokens_of_stream(r.text)
                assert done
                last = chunks[-1]
            else:
                last = r.json()
            assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
            assert len(last["output_ids"]) < LONG_NEW_TOKENS
        # A client that goes away after the first streamed chunk.
        async with client.stream("POST", f"{cluster.url}/generate",
                                 json={**body, "rid": "gone", "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break


def test_router_end_to_end_over_mooncake(tmp_path: Path) -> None:
    cases = workload()
    with ThreadPoolExecutor(1) as pool:
        # The reference runs while the processes start.
        want = pool.submit(references, cases)
        with Cluster(tmp_path) as cluster:
            run_checks(cluster, cases, want.result())


def run_checks(cluster: Cluster, cases: list[tuple[list[int], int]], want: list[list[int]]
               ) -> None:
    asyncio.run(concurrent(cluster.url, cases, want))
    wait_for(cluster.workers_idle, 30, "workers idle after the concurrent requests")
    asyncio.run(aborted(cluster))
    wait_for(cluster.workers_idle, 60, "workers idle after the aborts")
    metrics = httpx.get(f"{cluster.decode.url}/metrics", timeout=10).text
    aborts = [line for line in metrics.splitlines() if line.startswith(
        'pdlife_decode_requests_finished_total{reason="aborted",state="failed"}')]
    assert aborts and float(aborts[0].split()[-1]) >= 4, aborts
    for server in (cluster.prefill, cluster.decode):
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    # The router's /flush_cache reaches both workers, which answer as SGLang's do: the
    # prefill's cache is empty after it.
    def cached_pages() -> int:
        info = httpx.get(f"{cluster.prefill.url}/server_info", timeout=10).json()
        pages: int = info["kv_pool"]["prefill"]["prefix_cache_pages"]
        return pages

    assert cached_pages() > 0
    r = httpx.post(f"{cluster.url}/flush_cache", headers=cluster.headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["workers_flushed"] == r.json()["total_workers"] == 2, r.text
    assert cached_pages() == 0
