"""Service test fixtures: `pdlife serve` and the SGLang router as processes on loopback, and an
in-process service behind an ASGI transport.

Processes get free ports on 127.0.0.1, write their output to a log file (shown when they fail),
and are waited on through their HTTP endpoints with timeouts, never fixed sleeps. Callers stop
them in ``finally`` blocks or fixture teardowns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from scheduler.dist.ports import free_port as free_port  # the tests take it from here
from scheduler.service.app import create_app
from scheduler.service.core import ServeConfig, Service

ROOT = Path(__file__).resolve().parent.parent
PDLIFE = "import sys; from scheduler.cli.main import main; sys.exit(main())"
_POLL_S = 0.05


def model_flags(model: Any) -> list[str]:
    """The ``pdlife serve`` flags that build the reference model ``model`` (a ModelConfig)."""
    names = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "max_position",
             "seed")
    return [arg for name in names
            for arg in (f"--{name.replace('_', '-')}", str(getattr(model, name)))]




def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: wait() is an interruptible pause between polls
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        pause.wait(_POLL_S)


class Process:
    """A child process with its output in ``log``; :meth:`stop` ends it for sure."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            list(argv), stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )

    def tail(self, n: int = 4000) -> str:
        self._out.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        return self.proc.returncode


class Server(Process):
    """``pdlife serve`` on a free loopback port."""

    def __init__(self, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-c", PDLIFE, "serve", "--host", "127.0.0.1",
                          "--port", str(self.port), *args], log, env=env)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        def healthy() -> bool:
            self.check_alive(f"pdlife serve on {self.port}")
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(healthy, timeout, f"pdlife serve on {self.port} healthy")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.tail()}") from None

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}{path}", timeout=10)
        r.raise_for_status()
        return r.json()

    def answers_as_colocated(self, model: Any, prompts: list[list[int]]) -> None:
        """A batch of ``prompts`` (one new token each) is answered with the colocated model's
        first tokens (``model``: the reference model's ModelConfig, or a loaded
        ServedModel), and the pool is free again afterwards."""
        from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel

        r = httpx.post(f"{self.url}/generate", timeout=60, json={
            "input_ids": prompts, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
        colocated = ReferenceModel(LlamaModel(model)) if isinstance(model, ModelConfig) else model
        assert [a["output_ids"] for a in r.json()] == [
            colocated.generate(p, 1, ignore_eos=True) for p in prompts]
        wait_for(lambda: idle(self.get("/server_info")), 30, "the pool free again")


def idle(info: dict[str, Any]) -> bool:
    """No live request and every KV pool entirely free, per ``/server_info``."""
    counts = [n for states in info["requests"].values() for n in states.values()]
    pools = info["kv_pool"].values()
    return (
        info["live_requests"] == 0
        and not any(counts)
        and all(p["free_pages"] == p["total_pages"] for p in pools)
    )


def tokens_of_stream(body: str) -> tuple[list[dict[str, Any]], bool]:
    """The JSON chunks of an SSE body, and whether it ended with ``data: [DONE]``."""
    import json

    chunks, done = [], False
    for line in body.split("\n\n"):
        line = line.strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
        else:
            assert not done, "a chunk after [DONE]"
            chunks.append(json.loads(data))
    return chunks, done


@contextlib.contextmanager
def running_service(config: ServeConfig, **kwargs: Any) -> Iterator[Service]:
    service = Service(config, **kwargs)
    service.start_loop()
    try:
        yield service
    finally:
        service.close()


@contextlib.asynccontextmanager
async def asgi_client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://pdlife") as client:
        yield client


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class CutShort:
    """An HTTP endpoint on loopback (``port``, or a free one) that answers every request with a
    status line and headers promising a body, then closes the connection: a server going away
    mid-answer. A context manager giving its ``host:port``."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"

    def __init__(self, port: int = 0) -> None:
        self._sock = socket.create_server(("127.0.0.1", port))
        self._thread = threading.Thread(target=self._serve, name="cut-short", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return f"127.0.0.1:{self._sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed: the context ended
                return
            with conn:
                conn.recv(65536)
                conn.sendall(self.ANSWER)
