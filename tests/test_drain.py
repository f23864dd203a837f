"""SIGTERM drains a real ``pdlife serve`` process: it stops admitting (503 on /generate and
/health), finishes the request in flight, and exits 0."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from scheduler.model.reference import ModelConfig
from tests.service_harness import Server, tokens_of_stream

MODEL = ModelConfig.tiny()
NEW_TOKENS = 300


@pytest.mark.multiprocess
def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path: Path) -> None:
    server = Server(
        tmp_path / "serve.log", "--backend", "local", "--hidden", str(MODEL.hidden),
        "--heads", str(MODEL.heads), "--kv-heads", str(MODEL.kv_heads), "--head-dim",
        str(MODEL.head_dim), "--intermediate", str(MODEL.intermediate),
    )
    try:
        server.wait_healthy()
        body = {"input_ids": [3, 1, 4, 1, 5], "stream": True,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
        with httpx.Client(base_url=server.url, timeout=60) as client, client.stream(
            "POST", "/generate", json=body
        ) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            # The request is in flight: its first tokens arrived, the rest are being decoded.
            server.signal(signal.SIGTERM)
            with httpx.Client(base_url=server.url, timeout=10) as probe:
                health = probe.get("/health")
                assert health.status_code == 503
                assert health.json()["error"]["type"] == "draining"
                refused = probe.post("/generate", json={"input_ids": [1]})
                assert refused.status_code == 503
                assert refused.json()["error"]["type"] == "draining"
            rest = "\n\n".join([first, *lines])
        chunks, done = tokens_of_stream(rest)
        assert done
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert len(last["output_ids"]) == NEW_TOKENS
        assert server.wait(timeout=30) == 0, server.tail()
        assert "drained; shutting down" in server.tail()
    finally:
        server.stop()
