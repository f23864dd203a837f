"""End-to-end prefill throughput against the forward passes alone.

A fixed workload (mixed prompt lengths) goes through the whole prefill lifecycle — bootstrap
handshake, PrefillAdder batching, chunked forward, KV transfer to the decode peer over the local
backend, release — and every batch the scheduler formed is recorded. The same batches are then
run back to back through the same model on a fresh pool (forward only: no scheduler, no
transfer). Both run in this process, alternating, for each loop (normal and overlap); the ratio
of throughputs tells how much the lifecycle costs on top of the model. A loop's figure is the
median of its rounds' ratios; the better loop's goes on the RESULT line.

Last line: ``RESULT e2e ratio=<lifecycle ÷ forward-only throughput> ttft_p50_ms=.. ttft_p99_ms=..
loop=<the better loop>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from lifecycle import SamplingParams
from lifecycle.timeline import ttft_phases
from scheduler.embedded import EmbeddedPair, Outcome, PairConfig
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.prefill.config import SchedulerConfig
from scheduler.runner import ForwardBatch


class RecordingRunner:
    """The model runner, keeping every batch it ran."""

    def __init__(self, inner: PagedModelRunner) -> None:
        self.inner = inner
        self.pool = inner.pool
        self.batches: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch) -> list[int]:
        self.batches.append(batch)
        return self.inner.forward(batch)


def workload(n: int, lo: int, hi: int, seed: int) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    return {f"r{i}": [rnd.randrange(256) for _ in range(rnd.randint(lo, hi))] for i in range(n)}


def run_lifecycle(model: LlamaModel, prompts: dict[str, list[int]], overlap: bool,
                  page_size: int, chunk: int) -> tuple[float, list[float], list[ForwardBatch]]:
    total = sum(len(p) for p in prompts.values())
    pages = total // page_size + len(prompts) + 16
    cfg = PairConfig(
        scheduler=SchedulerConfig(page_size=page_size, chunked_prefill_size=chunk,
                                  max_prefill_tokens=chunk),
        prefill_pages=pages, decode_pages=pages, metadata_slots=len(prompts), overlap=overlap,
    )
    pair = EmbeddedPair(cfg, model=model)
    recorder = RecordingRunner(pair.prefill.runner)  # type: ignore[arg-type]
    pair.prefill.runner = recorder
    seconds, out, ttfts = serve_once(pair, prompts, timeout=1800)
    assert all(o.decode is not None and o.decode.ok for o in out.values())
    return seconds, ttfts, recorder.batches


def serve_once(pair: EmbeddedPair, prompts: dict[str, list[int]], timeout: float
               ) -> tuple[float, dict[str, Outcome], list[float]]:
    """Submit every prompt for one output token at once, drive ``pair`` until all are answered,
    close it. Returns the wall seconds, the outcomes (every prefill answer ok), and each
    request's prefill-side time to first token (admission to the transfer's conclusion)."""
    try:
        start = time.perf_counter()
        for rid, prompt in prompts.items():
            pair.submit(rid, prompt, SamplingParams(max_new_tokens=1))
        out = pair.run_until_done(prompts, timeout=timeout)
        seconds = time.perf_counter() - start
    finally:
        pair.close()
    ttfts = []
    for rid in prompts:
        assert out[rid].prefill.ok, out[rid].prefill
        req_ttft = ttft_phases(out[rid].prefill.timeline).total
        assert req_ttft is not None
        ttfts.append(req_ttft)
    return seconds, out, ttfts


def run_forward_only(model: LlamaModel, batches: list[ForwardBatch], pages: int,
                     page_size: int) -> float:
    runner = PagedModelRunner(model, model.make_pool(num_pages=pages, page_size=page_size))
    start = time.perf_counter()
    for batch in batches:
        runner.forward(batch)
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # The reference model is small: intra-op threads only contend with the transfer worker
    # (on 2 shared cores they made passes 5-30x slower, at random). Both sides run alike.
    torch.set_num_threads(1)

    model = LlamaModel(ModelConfig())
    prompts = workload(args.requests, args.min_len, args.max_len, args.seed)
    tokens = sum(len(p) for p in prompts.values())
    pages = tokens // args.page_size + len(prompts) + 16
    print(f"workload: {len(prompts)} requests, {tokens} prompt tokens, page size "
          f"{args.page_size}, chunk {args.chunk}")
    ratios: dict[str, list[float]] = {"normal": [], "overlap": []}
    ttfts_of: dict[str, list[float]] = {"normal": [], "overlap": []}
    for round_ in range(args.rounds):
        for loop in ("normal", "overlap"):
            life_s, ttfts, batches = run_lifecycle(model, prompts, loop == "overlap",
                                                   args.page_size, args.chunk)
            fwd_s = run_forward_only(model, batches, pages, args.page_size)
            ratio = fwd_s / life_s
            print(f"round {round_} {loop:8s} lifecycle {life_s:7.3f} s "
                  f"({tokens / life_s:8.0f} tok/s)  forward-only {fwd_s:7.3f} s "
                  f"({tokens / fwd_s:8.0f} tok/s)  ratio {ratio:.3f}  batches {len(batches)}")
            ratios[loop].append(ratio)
            ttfts_of[loop] += ttfts
    for name, rs in ratios.items():
        print(f"{name}: median ratio {statistics.median(rs):.3f} (rounds "
              + " ".join(f"{r:.3f}" for r in rs)
              + f"), ttft p50 {statistics.median(ttfts_of[name]) * 1e3:.1f} ms")
    loop = max(ratios, key=lambda k: statistics.median(ratios[k]))
    ratio, ttfts = statistics.median(ratios[loop]), ttfts_of[loop]
    print(f"RESULT e2e ratio={ratio:.3f} ttft_p50_ms={percentile(ttfts, 0.5) * 1e3:.1f} "
          f"ttft_p99_ms={percentile(ttfts, 0.99) * 1e3:.1f} loop={loop}")


if __name__ == "__main__":
    main()
