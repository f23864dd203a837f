"""SGLang's router in front of pdlife workers that require an API key (KV over Mooncake, all
processes on loopback). The router's ``--api-key`` does both halves: clients must send it to the
router, and the router sends it to the workers (``Authorization: Bearer``) on ``/generate`` and
its ``/server_info`` and ``/model_info`` look-ups; its health checks go to ``/health``, which is
open. So workers and router share one key."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from tests.service_harness import idle, model_flags, wait_for
from tests.test_router_e2e import Cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

KEY = "router-key-0123456789"
MODEL = ModelConfig.tiny()
MODEL_FLAGS = model_flags(MODEL)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tmp_path_factory.mktemp("router-key"), MODEL_FLAGS, api_key=KEY) as started:
        yield started


def test_the_router_passes_its_key_to_the_workers(cluster: Cluster) -> None:
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

        def worker_idle(url: str = worker.url) -> bool:
            return idle(httpx.get(f"{url}/server_info", headers=AUTH, timeout=10).json())

        wait_for(worker_idle, 60, "worker idle")
        assert info["role"] in ("prefill", "decode")
        metrics = httpx.get(f"{worker.url}/metrics", headers=AUTH, timeout=10).text
        served = [line for line in metrics.splitlines() if line.startswith(
            'pdlife_http_requests_total{method="POST",route="/generate",status="200"}')]
        assert served and float(served[0].split()[-1]) >= 2  # the probe and the request
