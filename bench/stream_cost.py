"""Stream cost: how much a streamed ``/generate`` slows an unrelated request on the same worker.

A ``pdlife serve --backend local`` worker (the reference model, as the server starts without
model flags) runs its engine thread in the HTTP process, so the CPU time the event loop spends
building and sending a stream's chunks is taken from every request's decoding. One request of
``--new-tokens`` tokens is timed alone, then again beside a ``/generate`` stream of as many
tokens that asks for ``return_logprob`` and ``top_logprobs_num`` 5 (started first), ``--runs``
times. With ``--baseline-root DIR`` a second worker runs the code of another checkout (its
``lifecycle``, ``kv`` and ``scheduler`` packages), and the rounds alternate between the two, so
both see the same machine; each worker runs alone while it is measured.

Last line: ``RESULT stream_cost ratio=<beside ÷ alone> alone_s=<median> beside_s=<median>
stream_mb=<..> [baseline_ratio=.. baseline_alone_s=.. baseline_beside_s=..
baseline_stream_mb=..]`` (the ratio: how much slower the stream makes a request beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scheduler.dist.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """``pdlife serve --backend local`` from the checkout at ``root`` on a free loopback port."""

    def __init__(self, root: Path, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler.cli", "serve", "--backend", "local", "--host",
             "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *flags],
            cwd=root, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {log}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


async def _plain(client: httpx.AsyncClient, url: str, tokens: int) -> float:
    started = time.monotonic()
    answer = await client.post(f"{url}/generate", json={
        "text": "other", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
    answer.raise_for_status()
    return time.monotonic() - started


async def _stream(client: httpx.AsyncClient, url: str, tokens: int,
                  begun: asyncio.Event) -> int:
    size = 0
    async with client.stream("POST", f"{url}/generate", json={
        "text": "hi", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        "stream": True, "return_logprob": True, "top_logprobs_num": 5,
    }) as answer:
        async for data in answer.aiter_bytes():
            size += len(data)
            begun.set()
    return size


async def _round(url: str, tokens: int) -> tuple[float, float, float]:
    """One round: the request alone, then beside the stream; seconds, seconds, stream MB."""
    async with httpx.AsyncClient(timeout=1800) as client:
        alone = await _plain(client, url, tokens)
        begun = asyncio.Event()
        stream = asyncio.ensure_future(_stream(client, url, tokens, begun))
        await asyncio.wait_for(begun.wait(), timeout=300)  # the stream is decoding
        beside = await _plain(client, url, tokens)
        size = await stream
    return alone, beside, size / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=1500,
                        help="tokens of the timed request and of the stream beside it (default: "
                        "%(default)s)")
    parser.add_argument("--runs", type=int, default=3,
                        help="rounds (each: alone, then beside the stream); medians reported "
                        "(default: %(default)s)")
    parser.add_argument("--baseline-root", type=Path, default=None,
                        help="a checkout to compare with, its worker measured in turns "
                        "(default: none)")
    parser.add_argument("--flags", default="", help="more pdlife serve flags, space-separated "
                        "(--flags=--incremental-streaming-output for one that starts with --; "
                        "default: none)")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="pdlife-stream-cost-"))
    roots = {"": ROOT} if args.baseline_root is None else {
        "baseline_": args.baseline_root.resolve(), "": ROOT}
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in roots}
    workers = {name: Worker(root, args.flags.split(), logs / f"{name or 'this'}.log")
               for name, root in roots.items()}
    try:
        for run in range(args.runs):
            for name, worker in workers.items():
                figure = asyncio.run(_round(worker.url, args.new_tokens))
                figures[name].append(figure)
                print(f"run {run} {name or 'this'}: alone {figure[0]:.2f} s, beside the stream "
                      f"{figure[1]:.2f} s, stream {figure[2]:.1f} MB", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    line = ["RESULT stream_cost"]
    for name in reversed(list(roots)):
        rounds = figures[name]
        alone = statistics.median(r[0] for r in rounds)
        beside = statistics.median(r[1] for r in rounds)
        line += [f"{name}ratio={beside / alone:.2f}", f"{name}alone_s={alone:.2f}",
                 f"{name}beside_s={beside:.2f}",
                 f"{name}stream_mb={statistics.median(r[2] for r in rounds):.1f}"]
    print(" ".join(line))


if __name__ == "__main__":
    main()
