"""SGLang's router in front of pdlife workers that require an API key (KV over Mooncake, all
processes on loopback). The router's ``--api-key`` does both halves: clients must send it to the
router, and the router sends it to the workers (``Authorization: Bearer``) on ``/generate`` and
its ``/server_info`` and ``/model_info`` look-ups; its health checks go to ``/health``, which is
open. So workers and router share one key."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scheduler.cli.credentials import API_KEY_ENV
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from tests.service_harness import Process, Server, free_port, idle, model_flags, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

KEY = "router-key-0123456789"
MODEL = ModelConfig.tiny()
MODEL_FLAGS = model_flags(MODEL)
AUTH = {"Authorization": f"Bearer {KEY}"}


class KeyedCluster:
    def __init__(self, tmp: Path) -> None:
        self.procs: list[Process] = []
        bootstrap = free_port()
        common = ["--backend", "mooncake", *MODEL_FLAGS]
        # One worker takes the key as SGLang's flag, the other from the environment.
        self.prefill = self._add(Server(tmp / "prefill.log", "--role", "prefill",
                                        "--bootstrap-port", str(bootstrap), "--api-key", KEY,
                                        *common))
        self.decode = self._add(Server(tmp / "decode.log", "--role", "decode", *common,
                                       env={API_KEY_ENV: KEY}))
        self.prefill.wait_healthy()  # /health needs no key
        self.decode.wait_healthy()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.router = self._add(Process([
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", self.prefill.url, str(bootstrap), "--decode", self.decode.url,
            "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", "round_robin", "--worker-startup-check-interval", "1",
            "--disable-retries", "--disable-circuit-breaker", "--log-level", "warn",
        ], tmp / "router.log"))
        wait_for(self._routes, 60, "router serving /generate")

    def _add(self, proc: Process) -> Process:
        self.procs.append(proc)
        return proc

    def _routes(self) -> bool:
        self.router.check_alive("sglang router")
        try:
            r = httpx.post(f"{self.url}/generate", headers=AUTH, timeout=10,
                           json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        except httpx.TransportError:
            return False
        return r.status_code == 200

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedCluster]:
    c = KeyedCluster(tmp_path_factory.mktemp("router-key"))
    try:
        yield c
    finally:
        c.stop()


def test_the_router_passes_its_key_to_the_workers(cluster: KeyedCluster) -> None:
    prompt = [(5 * k) % 256 for k in range(20)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    r = httpx.post(f"{cluster.url}/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == ReferenceModel(LlamaModel(MODEL)).generate(prompt, 6, (), True)
    # The router itself refuses a client without the key; so does each worker.
    assert httpx.post(f"{cluster.url}/generate", json=body, timeout=30).status_code == 401
    for worker in (cluster.prefill, cluster.decode):
        refused = httpx.post(f"{worker.url}/generate", json=body, timeout=30)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "unauthorized"
        info = httpx.get(f"{worker.url}/server_info", headers=AUTH, timeout=10).json()
        wait_for(lambda w=worker: idle(httpx.get(f"{w.url}/server_info", headers=AUTH,
                                                  timeout=10).json()), 60, "worker idle")
        assert info["role"] in ("prefill", "decode")
        metrics = httpx.get(f"{worker.url}/metrics", headers=AUTH, timeout=10).text
        served = [line for line in metrics.splitlines() if line.startswith(
            'pdlife_http_requests_total{method="POST",route="/generate",status="200"}')]
        assert served and float(served[0].split()[-1]) >= 2  # the probe and the request
