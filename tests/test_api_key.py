"""``--api-key``: every route but the health probes requires ``Authorization: Bearer <key>``;
anything else is answered 401 in the API's error shape, counted, before a byte of the body is
read. The check is middleware, so a route added to the app later is covered too."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from scheduler.cli.credentials import API_KEY_ENV
from scheduler.cli.main import main
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.app import create_app
from scheduler.service.core import ServeConfig
from scheduler.service.middleware import ApiKey
from tests.service_harness import Server, run, running_service

KEY = "k3y-0123456789abcdef"
MODEL = ModelConfig.tiny(seed=3)
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}


def config(api_key: str | None = KEY) -> ServeConfig:
    return ServeConfig(role="both", backend="local", model=MODEL,
                       scheduler=SchedulerConfig(page_size=4), pool_pages=64, metadata_slots=8,
                       max_body_bytes=4096, api_key=api_key)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(client: httpx.AsyncClient, method: str, path: str,
               headers: dict[str, str] | None = None) -> httpx.Response:
    body = GENERATE if path == "/generate" else {"rid": "nobody"} if method == "POST" else None
    return await client.request(method, path, json=body, headers=headers)


def metric(text: str, prefix: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return sum(float(line.split()[-1]) for line in lines)


# Every route of the API (and one that does not exist) and the key it needs.
GUARDED = [("POST", "/generate"), ("POST", "/abort_request"), ("GET", "/metrics"),
           ("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/model_info"),
           ("GET", "/v1/models"), ("GET", "/openapi.json"), ("POST", "/v1/chat/completions"),
           ("POST", "/v1/completions"), ("GET", "/nowhere")]
OPEN = [("GET", "/health"), ("GET", "/health_generate")]


def test_every_route_but_the_health_probes_needs_the_key() -> None:
    async def main() -> None:
        with running_service(config()) as service:
            app = create_app(service)

            @app.get("/added-later")
            async def added_later() -> dict[str, str]:
                return {"ok": "yes"}

            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://pdlife") as client:
                for method, path in [*GUARDED, ("GET", "/added-later")]:
                    for headers in (None, bearer("wrong"), {"Authorization": KEY},
                                    {"Authorization": f"Basic {KEY}"}, bearer(KEY + "x"),
                                    bearer(KEY[:-1])):
                        r = await call(client, method, path, headers)
                        assert r.status_code == 401, (method, path, headers, r.text)
                        assert r.headers["www-authenticate"] == "Bearer"
                        error = r.json()["error"]
                        if path.startswith("/v1/"):  # OpenAI's error object
                            assert error["type"] == "invalid_request_error", error
                            assert error["code"] == "unauthorized", error
                            assert error["param"] is None, error
                        else:
                            assert error["type"] == "unauthorized", error
                        assert "Authorization: Bearer" in error["message"]
                for method, path in OPEN:
                    r = await call(client, method, path)
                    assert r.status_code == 200, (path, r.text)
                r = await call(client, "POST", "/generate", bearer(KEY))
                assert r.status_code == 200, r.text
                assert len(r.json()["output_ids"]) == 2
                # The scheme is case-insensitive, as HTTP's are.
                assert (await call(client, "GET", "/added-later",
                                   {"Authorization": f"bearer {KEY}"})).json() == {"ok": "yes"}
                assert (await call(client, "POST", "/abort_request", bearer(KEY))
                        ).status_code == 404
                text = (await client.get("/metrics", headers=bearer(KEY))).text
                refused = 6 * (len(GUARDED) + 1)
                assert metric(text, 'pdlife_http_rejected_total{reason="unauthorized"}') == refused
                assert metric(text, "pdlife_http_requests_total") >= refused
                assert metric(text, 'pdlife_http_requests_total{method="POST",route="/generate"'
                              ',status="401"}') == 6

    run(main())


def test_a_stranger_is_refused_before_the_body_is_read() -> None:
    """A body over the limit from a client without the key gets 401, not 413: the key is checked
    first, so nobody without it makes the server buffer anything."""

    async def main() -> None:
        with running_service(config()) as service:
            transport = httpx.ASGITransport(app=create_app(service))
            async with httpx.AsyncClient(transport=transport, base_url="http://pdlife") as client:
                big = b"x" * 10_000
                r = await client.post("/generate", content=big)
                assert r.status_code == 401
                r = await client.post("/generate", content=big, headers=bearer(KEY))
                assert r.status_code == 413

    run(main())


def test_without_a_key_nothing_is_required() -> None:
    async def main() -> None:
        with running_service(config(api_key=None)) as service:
            transport = httpx.ASGITransport(app=create_app(service))
            async with httpx.AsyncClient(transport=transport, base_url="http://pdlife") as client:
                assert (await client.get("/server_info")).status_code == 200
                assert (await call(client, "POST", "/generate")).status_code == 200

    run(main())


def test_the_key_is_never_in_a_repr_and_never_empty() -> None:
    assert KEY not in repr(config())
    with pytest.raises(ValueError, match="must not be empty"):
        ApiKey(lambda *_: None, "", on_reject=lambda: None)  # type: ignore[arg-type,return-value]



@pytest.mark.multiprocess
def test_pdlife_top_reads_a_keyed_worker_with_the_key_from_the_environment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Server(tmp_path / "serve.log", "--backend", "local", "--page-size", "4",
                    "--pool-pages", "64", env={API_KEY_ENV: KEY})
    try:
        worker.wait_healthy()
        monkeypatch.setenv("COLUMNS", "200")
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        assert main(["top", worker.url, "--once", "--interval", "0.1"]) == 1
        assert f"answered 401 (the worker wants an API key: set {API_KEY_ENV})" in (
            capsys.readouterr().out)
        monkeypatch.setenv(API_KEY_ENV, KEY)
        assert main(["top", worker.url, "--once", "--interval", "0.1"]) == 0
        assert "both, healthy" in capsys.readouterr().out
    finally:
        worker.stop()
