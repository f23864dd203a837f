"""Overload: ten times what a server can hold, with the queue bound against without it.

Two ``pdlife serve --backend local`` processes on loopback (the tiny reference model; prefill
and decode in one process, so ``/generate`` answers whole requests), one with
``--max-queued-requests`` and one without, get the same open-loop load, one after the other: a
fixed number of requests (ten times the bounded server's queued plus running requests), sent at
a fixed rate above what either can serve, each a prompt of ``--prompt`` tokens asking for
``--new-tokens`` new tokens. Each server takes the load twice; the second round is measured, and
its resident memory is compared with the first round's. The servers' logs go to a temporary
folder, removed at the end unless the run failed or lost or leaked something; then its path is
printed.

For each server: the offered and admitted rates, the p99 latency of admitted requests (to their
last token) and of refused ones (503), requests that got neither (``lost``), KV pages still used
once the server is idle (``leaked_pages``) and the growth of its resident memory between the
rounds. The bounded server refuses what it cannot hold within milliseconds and keeps its admitted
latency bounded; the unbounded one admits everything, and its tail grows with the backlog.

Last line: ``RESULT overload ratio=<unbounded ÷ bounded admitted p99> offered=<rps>
admitted=<rps> refused_p99_ms=<..> admitted_p99_ms=<..> lost=<n> leaked_pages=<n>
rss_growth_mb=<..> unbounded_admitted_p99_ms=<..>`` (the bounded server's figures but the
last); the exit status is 1 if a request was lost or a page leaked on either server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import httpx

from scheduler.dist.ports import free_port
from scheduler.model.reference import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
MODEL = ModelConfig.tiny()
MODEL_FLAGS = ["--hidden", str(MODEL.hidden), "--layers", str(MODEL.layers), "--heads",
               str(MODEL.heads), "--kv-heads", str(MODEL.kv_heads), "--head-dim",
               str(MODEL.head_dim), "--intermediate", str(MODEL.intermediate),
               "--max-position", str(MODEL.max_position), "--seed", str(MODEL.seed)]


@attrs.frozen
class Round:
    offered_rps: float
    admitted_rps: float
    admitted_ms: list[float]
    refused_ms: list[float]
    lost: int


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


class Server:
    """``pdlife serve --backend local`` on a free loopback port."""

    def __init__(self, args: argparse.Namespace, max_queued: int | None, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        bound = [] if max_queued is None else ["--max-queued-requests", str(max_queued)]
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler.cli", "serve", "--backend", "local", "--host",
             "127.0.0.1", "--port", str(self.port), "--page-size", "4", "--pool-pages", "1024",
             "--max-running-requests", str(args.max_running), "--log-level", "warning",
             "--max-new-tokens-limit", str(args.new_tokens), *bound, *MODEL_FLAGS],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {log}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def used_pages_when_idle(self) -> int:
        """KV pages still used once nothing is live (the engine releases after answering)."""
        deadline = time.monotonic() + 60
        while True:
            info = httpx.get(f"{self.url}/server_info", timeout=10).json()
            used = sum(p["total_pages"] - p["free_pages"] for p in info["kv_pool"].values())
            if (info["live_requests"] == 0 and used == 0) or time.monotonic() > deadline:
                return int(used)
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], new_tokens: int,
              at: float, out: dict[str, list[float]]) -> None:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens,
                                                     "ignore_eos": True}}
    start = time.perf_counter()
    try:
        r = await client.post(f"{url}/generate", json=body)
    except httpx.HTTPError:
        out["lost"].append(0.0)
        return
    ms = (time.perf_counter() - start) * 1000
    if r.status_code == 200 and len(r.json()["output_ids"]) == new_tokens:
        out["admitted"].append(ms)
    elif r.status_code == 503 and r.headers.get("retry-after"):
        out["refused"].append(ms)
    else:
        out["lost"].append(ms)


async def load(url: str, args: argparse.Namespace, seed: int) -> Round:
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(args.prompt)] for _ in range(args.requests)]
    out: dict[str, list[float]] = {"admitted": [], "refused": [], "lost": []}
    limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=args.requests)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, url, p, args.new_tokens, start + i / args.rate, out)
                               for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - start
    sent_over = max((args.requests - 1) / args.rate, 1e-9)
    return Round(offered_rps=args.requests / sent_over if args.requests > 1 else 0.0,
                 admitted_rps=len(out["admitted"]) / seconds, admitted_ms=out["admitted"],
                 refused_ms=out["refused"], lost=len(out["lost"]))


def measure(args: argparse.Namespace, max_queued: int | None, log: Path
            ) -> tuple[Round, int, float]:
    """The measured (second) round, the pages used once idle, the RSS growth in MB."""
    server = Server(args, max_queued, log)
    try:
        asyncio.run(load(server.url, args, seed=1))
        leaked = server.used_pages_when_idle()
        rss_first = server.rss_mb()
        measured = asyncio.run(load(server.url, args, seed=2))
        leaked = max(leaked, server.used_pages_when_idle())
        return measured, leaked, server.rss_mb() - rss_first
    finally:
        server.stop()


def report(name: str, r: Round, leaked: int, growth: float) -> None:
    print(f"{name:>9}: offered {r.offered_rps:6.1f}/s  admitted {len(r.admitted_ms):4d} "
          f"({r.admitted_rps:5.1f}/s, p99 {p99(r.admitted_ms):7.1f} ms)  refused "
          f"{len(r.refused_ms):4d} (p99 {p99(r.refused_ms):6.1f} ms)  lost {r.lost}  "
          f"leaked pages {leaked}  RSS growth {growth:+.1f} MB", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-queued", type=int, default=16,
                    help="the bounded server's --max-queued-requests (default: %(default)s)")
    ap.add_argument("--max-running", type=int, default=8,
                    help="both servers' --max-running-requests (default: %(default)s)")
    ap.add_argument("--times", type=int, default=10,
                    help="requests sent, as a multiple of what the bounded server holds "
                         "(default: %(default)s)")
    ap.add_argument("--rate", type=float, default=200.0,
                    help="requests sent per second (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=32,
                    help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=16,
                    help="new tokens asked per request (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="a request's client timeout, seconds (default: %(default)s)")
    args = ap.parse_args()
    args.requests = args.times * (args.max_queued + args.max_running)
    logs = Path(tempfile.mkdtemp(prefix="pdlife-overload-"))  # the servers' output
    status = 1  # until the run ends with nothing lost or leaked: keep the logs
    try:
        status = run(args, logs)
        return status
    finally:
        if status:
            print(f"the servers' logs are kept in {logs}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(logs, ignore_errors=True)


def run(args: argparse.Namespace, logs: Path) -> int:
    """Both servers in turn, their logs in ``logs``; the exit status."""
    print(f"{args.requests} requests at {args.rate:g}/s, prompts of {args.prompt} tokens, "
          f"{args.new_tokens} new tokens each; the bounded server holds {args.max_queued} "
          f"queued + {args.max_running} running", flush=True)
    bounded = measure(args, args.max_queued, logs / "bounded.log")
    report("bounded", *bounded)
    unbounded = measure(args, None, logs / "unbounded.log")
    report("unbounded", *unbounded)
    b, leaked, growth = bounded
    u, u_leaked, _ = unbounded
    ratio = p99(u.admitted_ms) / max(p99(b.admitted_ms), 1e-9)
    print(f"RESULT overload ratio={ratio:.2f} offered={b.offered_rps:.1f} "
          f"admitted={b.admitted_rps:.1f} refused_p99_ms={p99(b.refused_ms):.1f} "
          f"admitted_p99_ms={p99(b.admitted_ms):.1f} lost={b.lost + u.lost} "
          f"leaked_pages={leaked + u_leaked} rss_growth_mb={growth:.1f} "
          f"unbounded_admitted_p99_ms={p99(u.admitted_ms):.1f}", flush=True)
    return 1 if b.lost + u.lost or leaked + u_leaked else 0

if __name__ == "__main__":
    sys.exit(main())
