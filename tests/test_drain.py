"""SIGTERM drains a real ``pdlife serve`` process: it stops admitting (503 on /generate and
/health), finishes the request in flight, and exits 0; a drain that had to abort requests (its
timeout, or a second signal) exits 3; a port in use is refused before anything starts. Sizes on
the command line take units."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import socket
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from scheduler.cli import serve
from scheduler.cli.command import UsageError
from scheduler.cli.main import build_parser, main
from scheduler.cli.serve import (
    EXIT_DRAIN_ABORTED,
    byte_size,
    check_rdma,
    memory_total,
    serve_config,
)
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.config import ServeConfig
from scheduler.service.core import Service
from tests.service_harness import (
    Server,
    asgi_client,
    free_port,
    model_flags,
    run,
    running_service,
    tokens_of_stream,
    wait_for,
)

MODEL = ModelConfig.tiny()
NEW_TOKENS = 300


@pytest.mark.multiprocess
@pytest.mark.mooncake
def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path: Path) -> None:
    """A decode worker holds a streamed request that waits for its prefill: the test alone
    decides when the KV comes (it sends the prefill its half only after the probes), so the
    request is in flight while the drain refuses new work, however the threads are scheduled."""
    bootstrap_port = free_port()
    flags = ["--backend", "mooncake", *model_flags(MODEL)]
    prefill = Server(tmp_path / "prefill.log", "--role", "prefill", "--bootstrap-port",
                     str(bootstrap_port), *flags)
    decode = Server(tmp_path / "decode.log", "--role", "decode", *flags)
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        body = {"input_ids": [3, 1, 4, 1, 5], "rid": "held", "stream": True,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                "bootstrap_room": 11}
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(client.post, f"{decode.url}/generate", json=body)
            wait_for(lambda: decode.get("/server_info")["live_requests"] == 1, 30,
                     "the decode worker holding the request")
            decode.signal(signal.SIGTERM)
            wait_for(lambda: "draining: no new requests" in decode.tail(200_000), 30,
                     "the decode worker draining")
            with httpx.Client(base_url=decode.url, timeout=10) as probe:
                health = probe.get("/health")
                assert health.status_code == 503
                assert health.json()["error"]["type"] == "draining"
                refused = probe.post("/generate", json={"input_ids": [1]})
                assert refused.status_code == 503
                assert refused.json()["error"]["type"] == "draining"
                metrics = probe.get("/metrics").text
                assert 'pdlife_http_rejected_total{reason="draining"} 1.0' in metrics
            # Only now does the KV leave the prefill: the held request decodes to its end.
            assert client.post(f"{prefill.url}/generate", json=body).status_code == 200
            answer = streamed.result(timeout=120)
        assert answer.status_code == 200, answer.text
        chunks, done = tokens_of_stream(answer.text)
        assert done
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert len(last["output_ids"]) == NEW_TOKENS
        assert decode.wait(timeout=30) == 0, decode.tail()
        assert "drained; shutting down" in decode.tail()
    finally:
        decode.stop()
        prefill.stop()


@pytest.mark.multiprocess
@pytest.mark.mooncake
@pytest.mark.parametrize(("drain_timeout", "why"), [
    ("0.2", "its drain timeout of 0.2 s ran out first"),
    ("3600", "a second signal ended its drain"),
], ids=["drain-timeout", "second-signal"])
def test_a_drain_that_aborts_requests_exits_3(tmp_path: Path, drain_timeout: str,
                                              why: str) -> None:
    """A prefill whose request waits for a decode peer that never comes: the drain times out,
    or a second SIGINT ends it, and aborts the request (the client gets a 503 saying so), and
    the exit status says so. A timed-out drain lingers (``--drain-linger``) as a complete one
    does; a second signal ends the linger too."""
    bootstrap_port = free_port()
    server = Server(tmp_path / "serve.log", "--backend", "mooncake", "--role", "prefill",
                    "--bootstrap-port", str(bootstrap_port), "--drain-timeout", drain_timeout,
                    "--drain-linger", "0.2")
    try:
        server.wait_healthy()
        body = {"input_ids": [3, 1, 4], "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bootstrap_port, "bootstrap_room": 7}
        answers: list[httpx.Response] = []
        with httpx.Client(base_url=server.url, timeout=60) as client:
            waiting = threading.Thread(target=lambda: answers.append(
                client.post("/generate", json=body)))
            waiting.start()
            wait_for(lambda: server.get("/server_info")["live_requests"] == 1, 30,
                     "the request admitted")
            if drain_timeout == "3600":  # a Ctrl-C, then another
                server.signal(signal.SIGINT)
                wait_for(lambda: "draining: no new requests" in server.tail(200_000), 30,
                         "the server draining")
                server.signal(signal.SIGINT)
            else:
                server.signal(signal.SIGTERM)
            waiting.join(60)
        # Not a client's abort: a 503 (retry elsewhere) that says why.
        assert answers[0].status_code == 503, answers[0].text
        error = answers[0].json()["error"]
        assert error["message"] == f"aborted: the server is shutting down ({why})", error
        assert server.wait(timeout=30) == EXIT_DRAIN_ABORTED, server.tail()
        assert "the drain aborted 1 requests" in server.tail()
        assert "drained; shutting down" not in server.tail()  # it did not drain
        lingered = "aborted the rest; refusing new requests for 0.2 s" in server.tail()
        assert lingered == (drain_timeout == "0.2"), server.tail()
    finally:
        server.stop()


@pytest.mark.mooncake
def test_the_servers_own_abort_counts_as_shutdown_not_as_the_clients() -> None:
    """What a timed-out drain aborts fails ``shutdown`` in the metrics (and traces), with a
    503 that says why; a client's abort of the same kind of request stays ``aborted``."""
    config = ServeConfig(role="prefill", backend="mooncake", model=MODEL,
                         scheduler=SchedulerConfig(page_size=4), pool_pages=16,
                         bootstrap_port=free_port())
    why = "aborted: the server is shutting down (a test)"

    async def main() -> str:
        with running_service(config) as service:
            async with asgi_client(service) as client:
                def waiting(rid: str, room: int) -> asyncio.Future[httpx.Response]:
                    return asyncio.ensure_future(client.post("/generate", json={
                        "rid": rid, "input_ids": [3, 1, 4], "bootstrap_host": "127.0.0.1",
                        "bootstrap_port": config.bootstrap_port, "bootstrap_room": room}))

                async def live(n: int) -> None:
                    for _ in range(3000):  # no decode peer comes: it waits (30 s at most)
                        if service.live_requests() == n:
                            return
                        await asyncio.sleep(0.01)
                    raise TimeoutError(f"not {n} live requests")

                by_client = waiting("by-client", 7)
                await live(1)
                assert service.abort("by-client")
                assert (await asyncio.wait_for(by_client, 30)).status_code == 200
                await live(0)  # the engine thread lets it go after its answer
                by_server = waiting("by-server", 8)
                await live(1)
                assert service.abort_all(why) == 1
                r = await asyncio.wait_for(by_server, 30)
                assert (r.status_code, r.json()["error"]["message"]) == (503, why), r.text
                return (await client.get("/metrics")).text

    metrics = run(main())
    finished = {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in metrics.splitlines()
                if line.startswith("pdlife_requests_finished_total{")}
    assert finished['pdlife_requests_finished_total{reason="aborted",state="failed"}'] == "1.0"
    assert finished['pdlife_requests_finished_total{reason="shutdown",state="failed"}'] == "1.0"


def test_closing_a_service_answers_what_is_live_and_refuses_what_comes_after(
        caplog: pytest.LogCaptureFixture) -> None:
    """An embedder's ``Service.close()`` with a request still live (no drain before it): the
    engines end it as the server's abort (503), its pages back, not left waiting on a loop
    that steps nothing any more; a request that comes after is refused 503 (the server is
    closed), not registered."""
    config = ServeConfig(role="both", backend="local", model=MODEL, pool_pages=128)

    async def main() -> tuple[httpx.Response, httpx.Response, int]:
        service = Service(config)
        service.start_loop()
        try:
            async with asgi_client(service) as client:
                live = asyncio.ensure_future(client.post("/generate", json={
                    "rid": "live", "input_ids": [3, 1, 4],
                    "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}))
                assert service.decode is not None and service.prefill is not None
                decode_pool = service.decode.pool
                for _ in range(3000):  # decoding, thousands of passes from its end
                    if decode_pool.allocator.available() < decode_pool.num_pages or live.done():
                        break
                    await asyncio.sleep(0.01)
                assert not live.done(), live.result().text
                service.close()
                answered = await asyncio.wait_for(live, 30)
                after = await client.post("/generate", json={
                    "rid": "after", "input_ids": [3, 1, 4],
                    "sampling_params": {"max_new_tokens": 2}})
                for side in (service.prefill, service.decode):  # ended by the engines
                    assert side.pool.allocator.available() == side.pool.num_pages
                return answered, after, service.live_requests()
        finally:
            service.close()  # a second close does nothing more

    with caplog.at_level(logging.WARNING):
        answered, after, live_after = run(main())
    assert "closing a PrefillScheduler with" not in caplog.text, caplog.text
    assert answered.status_code == 503, answered.text
    assert answered.json()["error"]["message"] == "the server closed before the request ended"
    assert after.status_code == 503, after.text
    assert after.json()["error"]["message"] == "the server is closed"
    assert live_after == 0


@pytest.mark.multiprocess
def test_a_drained_server_lingers_refusing_until_its_linger_ends_or_a_second_signal(
    tmp_path: Path,
) -> None:
    """With --drain-linger the drained server keeps its port, refusing new requests as draining,
    so a router whose health check has not noticed yet gets a refusal rather than a closed
    port; a second signal ends the linger, and a short linger ends by itself (exit 0 both)."""
    server = Server(tmp_path / "serve.log", "--backend", "local", "--drain-linger", "3600")
    short = Server(tmp_path / "short.log", "--backend", "local", "--drain-linger", "0.2")
    try:
        server.wait_healthy()
        short.wait_healthy()
        server.signal(signal.SIGTERM)
        short.signal(signal.SIGTERM)
        wait_for(lambda: "refusing new requests for 3600 s" in server.tail(), 30, "the linger")
        with httpx.Client(base_url=server.url, timeout=10) as probe:
            assert probe.get("/health").json()["error"]["type"] == "draining"
            refused = probe.post("/generate", json={"input_ids": [1]})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "draining"
        server.signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, server.tail()
        assert short.wait(timeout=30) == 0, short.tail()
        assert "refusing new requests for 0.2 s" in short.tail()
        assert "drained; shutting down" in short.tail()
    finally:
        server.stop()
        short.stop()


@pytest.mark.parametrize(("flags", "says"), [
    (["--drain-linger=-1"], "--drain-linger must be >= 0, got -1"),
    (["--drain-timeout=-1"], "--drain-timeout must be >= 0, got -1"),
    (["--chunked-prefill-size=-5"], "--chunked-prefill-size must be >= 0 (0 disables chunking)"),
    (["--schedule-policy", "lpm", "--disable-radix-cache"],
     "--schedule-policy lpm orders prompts by their cached prefix: it needs the prefix cache"),
    # The configuration's own refusals name the flags, not its fields.
    (["--pool-pages", "0"], "--pool-pages must be > 0: 0"),
    (["--waiting-timeout", "0"], "--waiting-timeout must be > 0: 0.0"),
    (["--max-new-tokens-limit", "99999"], "--max-new-tokens-limit must be in 1..8192"),
    (["--connect-timeout", "0"], "--connect-timeout must be > 0"),
    (["--drain-timeout", "nan"], "--drain-timeout must be a finite number of seconds, got nan"),
    (["--metadata-slots", str(10**11)], f"--metadata-slots {10**11} takes 95367.4 GiB a side"),
])
def test_a_value_out_of_range_is_refused_naming_its_flag(flags: list[str], says: str) -> None:
    args = build_parser("serve").parse_args(["serve", "--backend", "local", *flags])
    with pytest.raises(UsageError) as info:
        serve_config(args)
    assert str(info.value).startswith(says), info.value


def test_an_allowed_prefill_must_be_an_address() -> None:
    args = build_parser("serve").parse_args(
        ["serve", "--role", "decode", "--allow-prefill", "10.0.0.1:8998,garbage"])
    with pytest.raises(UsageError, match="--allow-prefill: 'garbage' is not a prefill's "
                                         "bootstrap address, HOST:PORT"):
        serve_config(args)
    for empty in ("", ","):  # an unset shell variable: it would have allowed any prefill
        args = build_parser("serve").parse_args(
            ["serve", "--role", "decode", "--allow-prefill", empty])
        with pytest.raises(UsageError, match="an empty address; give HOST:PORT, or leave the "
                                             "flag out to allow any prefill"):
            serve_config(args)


@pytest.mark.parametrize("flag", ["--port", "--bootstrap-port"])
def test_a_port_beyond_65535_is_a_usage_error(flag: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser("serve").parse_args(["serve", "--role", "prefill", flag, "70000"])
    assert info.value.code == 2
    assert f"argument {flag}: must be a port number, 0-65535, got '70000'" in \
        capsys.readouterr().err


def test_rdma_is_refused_where_the_machine_has_no_such_device(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="rdma: this machine has no RDMA device"):
        check_rdma("", str(tmp_path / "none"))
    (tmp_path / "mlx5_0").mkdir()
    check_rdma("", str(tmp_path))
    check_rdma("mlx5_0", str(tmp_path))
    with pytest.raises(UsageError, match=r"no RDMA device mlx5_1 here; .* lists mlx5_0"):
        check_rdma("mlx5_0,mlx5_1", str(tmp_path))


def test_a_host_that_cannot_be_bound_is_named_not_the_port(
        capsys: pytest.CaptureFixture[str]) -> None:
    host = "192.0.2.1"  # TEST-NET-1: never an address of this machine, and no name to look up
    with pytest.raises(SystemExit) as info:
        main(["serve", "--backend", "local", "--host", host, "--port", str(free_port()),
              *model_flags(MODEL)])
    assert info.value.code == 2
    assert f"--host {host}: not an address of this machine (" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_an_idle_server_exits_zero_on_sigterm(tmp_path: Path) -> None:
    server = Server(tmp_path / "serve.log", "--backend", "local")
    try:
        server.wait_healthy()
        server.signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, server.tail()
        assert "drained; shutting down" in server.tail()
    finally:
        server.stop()


@pytest.mark.parametrize("flag", ["--port", "--bootstrap-port"])
def test_a_port_in_use_is_refused_before_anything_starts(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--bootstrap-port": str(free_port()), flag: str(port)}
        with pytest.raises(SystemExit) as info:
            main(["serve", "--role", "prefill", "--backend", "mooncake", "--host", "127.0.0.1",
                  *(arg for item in ports.items() for arg in item), *model_flags(MODEL)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in err


def test_an_ipv6_host_is_refused_for_a_prefill_bootstrap(capsys: pytest.CaptureFixture[str],
                                                          ) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--role", "prefill", "--backend", "mooncake", "--host", "::",
              "--port", str(free_port()), "--bootstrap-port", str(free_port()),
              *model_flags(MODEL)])
    assert info.value.code == 2
    assert "--host ::: the bootstrap endpoint listens on IPv4 only" in capsys.readouterr().err


def test_no_writable_temporary_directory_is_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def none_usable() -> str:  # what tempfile says on a read-only root file system
        raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp', '/var/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", none_usable)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--role", "decode", "--backend", "mooncake", "--port", str(free_port()),
              *model_flags(MODEL)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "No usable temporary directory found in ['/tmp', '/var/tmp']: pdlife serve writes" \
        in err and "mount a writable directory at /tmp or set TMPDIR" in err, err


def test_the_bootstrap_port_must_not_be_the_http_port(capsys: pytest.CaptureFixture[str]) -> None:
    port = str(free_port())
    with pytest.raises(SystemExit) as info:
        main(["serve", "--role", "prefill", "--backend", "mooncake", "--port", port,
              "--bootstrap-port", port, *model_flags(MODEL)])
    assert info.value.code == 2
    assert f"--bootstrap-port {port} is --port too" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "size"), [("65536", 65536), ("64KiB", 65536),
                                            ("8MiB", 8 << 20), ("1 GB", 10**9), ("2b", 2),
                                            ("1TiB", 1 << 40), ("3tb", 3 * 10**12)])
def test_sizes_take_units(text: str, size: int) -> None:
    assert byte_size(text) == size


def test_a_size_without_a_number_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: '8 megs'"):
        byte_size("8 megs")


def test_the_pool_is_sized_one_way_and_within_the_machines_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--pool-pages`` and ``--kv-cache-memory`` are one choice (one was silently dropped);
    a pool larger than the machine is refused before it is allocated, not with torch's
    traceback."""
    with pytest.raises(SystemExit) as both:
        build_parser("serve").parse_args(["serve", "--pool-pages", "64",
                                          "--kv-cache-memory", "1MiB"])
    assert both.value.code == 2
    assert "--kv-cache-memory: not allowed with argument --pool-pages" in capsys.readouterr().err
    total = memory_total()
    assert total is not None and total > 0  # Linux: /proc/meminfo
    pages = total // (16 * 512) + 1  # the reference model's 512 bytes a token, 16 a page
    for backend, pools in (("fake", ""), ("local", " each, 2 of them (prefill and decode)")):
        args = build_parser("serve").parse_args([
            "serve", "--role", "prefill", "--backend", backend, "--pool-pages", str(pages)])
        if backend == "local":
            args = build_parser("serve").parse_args([
                "serve", "--backend", backend, "--pool-pages", str(pages // 2 + 1)])
        with pytest.raises(UsageError, match=rf"^the KV pool takes [0-9.]+ GiB{re.escape(pools)}, "
                                             r"more than the [0-9.]+ GiB of memory this machine"):
            serve_config(args)
    fits = build_parser("serve").parse_args(["serve", "--backend", "local", "--pool-pages",
                                             str(pages // 4)])
    assert serve_config(fits).pool_pages == pages // 4


def test_a_containers_memory_limit_bounds_the_pool(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a cgroup memory limit smaller than the machine (a Kubernetes pod's), the limit
    is what a pool must fit; "max" is no limit."""
    unlimited, limited = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    unlimited.write_text("max\n")
    limited.write_text(f"{64 << 20}\n")  # 64 MiB
    monkeypatch.setattr(serve, "_CGROUP_LIMITS", (str(unlimited),))
    machine = memory_total()
    assert machine is not None and machine > 64 << 20
    monkeypatch.setattr(serve, "_CGROUP_LIMITS", (str(unlimited), str(limited)))
    assert memory_total() == 64 << 20
    # The reference model's 512 bytes a token: 8,193 pages of 16 are just over 64 MiB.
    args = build_parser("serve").parse_args(["serve", "--role", "prefill", "--backend",
                                             "fake", "--pool-pages", "8193"])
    with pytest.raises(UsageError, match=r"more than the 0\.1 GiB of memory this machine \(or "
                                         r"its container's memory limit\) allows"):
        serve_config(args)
    args = build_parser("serve").parse_args(["serve", "--role", "prefill", "--backend",
                                             "fake", "--pool-pages", "8192"])
    assert serve_config(args).pool_pages == 8192
