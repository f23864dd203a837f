"""End-to-end prefill throughput against the forward passes alone.

A fixed workload (mixed prompt lengths) goes through the whole prefill lifecycle — bootstrap
handshake, PrefillAdder batching, chunked forward, KV transfer to the decode peer over the local
backend, release — and every batch the scheduler formed is recorded. The same batches are then
run back to back through the same model on a fresh pool (forward only: no scheduler, no
transfer). Both run in this process, alternating, for each loop (normal and overlap); the ratio
of throughputs tells how much the lifecycle costs on top of the model. A loop's figure is the
median of its rounds' ratios; the better loop's goes on the RESULT line, with the overlap loop's
lifecycle throughput over the normal loop's (the median of the rounds, each round running the
two loops back to back).

``--model reference`` (the default) is the fixed-point reference model; ``--model smollm2`` (or
a path) a real checkpoint, with a smaller default workload (SmolLM2 computes a few hundred prompt
tokens a second on one core).

Each loop's forwards are timed as they run: ``gap_ms_<loop>`` is the mean time from one
forward's end to the next one's start, the time the model waits for the scheduler's host work,
which the overlap loop exists to hide.

``replay_control`` is ``overlap_vs_normal``'s quotient taken over the two loops' forward-only
replays instead (the normal loop's replay seconds over the overlap loop's, median of the
rounds): the same kind of work run twice, so how far it strays from 1.0 is the machine's noise
at this many rounds, against which ``overlap_vs_normal`` reads.

Last line: ``RESULT e2e ratio=<lifecycle ÷ forward-only throughput> overlap_vs_normal=<overlap
÷ normal lifecycle throughput> ttft_p50_ms=.. ttft_p99_ms=.. loop=<the better loop> model=..
gap_ms_normal=.. gap_ms_overlap=.. replay_control=..``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch

from bench import bench_model
from lifecycle import SamplingParams
from lifecycle.timeline import ttft_phases
from scheduler.embedded import EmbeddedPair, Outcome, PairConfig
from scheduler.malloc_arena import use_one_arena
from scheduler.model.select import ServedModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.runner import ForwardBatch, ModelRunner

#: The default workload of each kind of model: requests, shortest and longest prompt, and the
#: chunk (the most prompt tokens of one forward).
WORKLOADS = {"reference": (64, 128, 1024, 2048), "real": (16, 64, 512, 1024)}


class RecordingRunner:
    """The model runner, keeping every batch it ran and when each forward began and ended."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.pool = inner.pool
        self.batches: list[ForwardBatch] = []
        self.spans: list[tuple[float, float]] = []

    def forward(self, batch: ForwardBatch) -> list[int]:
        self.batches.append(batch)
        start = time.perf_counter()
        try:
            return self.inner.forward(batch)
        finally:
            self.spans.append((start, time.perf_counter()))

    def gaps(self) -> list[float]:
        """Seconds between one forward's end and the next one's start: the time the model
        waits for the scheduler, which the overlap loop exists to hide."""
        return [b[0] - a[1] for a, b in itertools.pairwise(self.spans)]


def workload(n: int, lo: int, hi: int, seed: int, vocab: int = 256) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    return {f"r{i}": [rnd.randrange(vocab) for _ in range(rnd.randint(lo, hi))]
            for i in range(n)}


def run_lifecycle(served: ServedModel, prompts: dict[str, list[int]], overlap: bool,
                  page_size: int, chunk: int) -> tuple[float, list[float], RecordingRunner]:
    total = sum(len(p) for p in prompts.values())
    pages = total // page_size + len(prompts) + 16
    cfg = PairConfig(
        scheduler=SchedulerConfig(page_size=page_size, chunked_prefill_size=chunk,
                                  max_prefill_tokens=chunk),
        prefill_pages=pages, decode_pages=pages, metadata_slots=len(prompts), overlap=overlap,
    )
    pair = EmbeddedPair(cfg, served=served)
    recorder = RecordingRunner(pair.prefill.runner)
    pair.prefill.runner = recorder
    seconds, out, ttfts = serve_once(pair, prompts, timeout=1800)
    assert all(o.decode.ok for o in out.values())
    return seconds, ttfts, recorder


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


def run_forward_only(served: ServedModel, batches: list[ForwardBatch], pages: int,
                     page_size: int) -> float:
    runner = served.runner(served.model,
                           served.make_pool(num_pages=pages, page_size=page_size))
    start = time.perf_counter()
    for batch in batches:
        runner.forward(batch)
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference",
                    help="reference (default), smollm2, or a GGUF file / Hugging Face directory")
    ap.add_argument("--requests", type=int,
                    help="requests (default: 64 on the reference model, 16 on a real one)")
    ap.add_argument("--min-len", type=int, help="shortest prompt (default: 128; real: 64)")
    ap.add_argument("--max-len", type=int, help="longest prompt (default: 1024; real: 512)")
    ap.add_argument("--page-size", type=int, default=16,
                    help="tokens per KV page (default: %(default)s)")
    ap.add_argument("--chunk", type=int,
                    help="most prompt tokens per forward (default: 2048; real: 1024)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of both loops (default: 5)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the prompts' lengths and tokens (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on 2 shared cores more threads only "
                         "contend with the transfer worker and made passes 5-30x slower)")
    args = ap.parse_args()
    # Both loops and the forward-only replay allocate from one malloc arena, as the overlap
    # loop's device worker would set later anyway (scheduler.malloc_arena).
    use_one_arena()
    torch.set_num_threads(args.threads)

    served = bench_model(args.model)
    defaults = WORKLOADS["reference" if served.is_reference else "real"]
    requests, lo, hi, chunk = (given if given is not None else default for given, default in zip(
        (args.requests, args.min_len, args.max_len, args.chunk), defaults, strict=True))
    # The reference model reads bytes; a real one any id of its vocabulary.
    vocab = 256 if served.is_reference else served.vocab_size
    prompts = workload(requests, lo, hi, args.seed, vocab)
    tokens = sum(len(p) for p in prompts.values())
    pages = tokens // args.page_size + len(prompts) + 16
    print(f"model {args.model}, {args.threads} thread(s); workload: {len(prompts)} requests, "
          f"{tokens} prompt tokens, page size {args.page_size}, chunk {chunk}")
    ratios: dict[str, list[float]] = {"normal": [], "overlap": []}
    ttfts_of: dict[str, list[float]] = {"normal": [], "overlap": []}
    speedups: list[float] = []  # per round: normal lifecycle seconds / overlap's
    # The same quotient for the two loops' forward-only replays: the same kind of work, twice,
    # so what it strays from 1.0 is this machine's noise, the yardstick for overlap_vs_normal.
    replays: list[float] = []
    gaps_of: dict[str, list[float]] = {"normal": [], "overlap": []}
    for round_ in range(args.rounds):
        lifecycle_s: dict[str, float] = {}
        replay_s: dict[str, float] = {}
        # The loops take turns going first, so a drift in the machine's load favours neither.
        for loop in ("normal", "overlap") if round_ % 2 == 0 else ("overlap", "normal"):
            life_s, ttfts, recorder = run_lifecycle(served, prompts, loop == "overlap",
                                                    args.page_size, chunk)
            lifecycle_s[loop] = life_s
            fwd_s = replay_s[loop] = run_forward_only(served, recorder.batches, pages,
                                                      args.page_size)
            ratio = fwd_s / life_s
            busy = sum(end - start for start, end in recorder.spans)
            gaps = recorder.gaps()
            gaps_of[loop] += gaps
            print(f"round {round_} {loop:8s} lifecycle {life_s:7.3f} s "
                  f"({tokens / life_s:8.0f} tok/s)  forward-only {fwd_s:7.3f} s "
                  f"({tokens / fwd_s:8.0f} tok/s)  ratio {ratio:.3f}  "
                  f"batches {len(recorder.batches)}  forwards {busy:7.3f} s, between them "
                  f"{sum(gaps) * 1e3:.1f} ms")
            ratios[loop].append(ratio)
            ttfts_of[loop] += ttfts
        speedups.append(lifecycle_s["normal"] / lifecycle_s["overlap"])
        replays.append(replay_s["normal"] / replay_s["overlap"])
        print(f"round {round_} overlap vs normal lifecycle throughput {speedups[-1]:.3f} "
              f"(their forward-only replays: {replays[-1]:.3f})")
    for name, rs in ratios.items():
        print(f"{name}: median ratio {statistics.median(rs):.3f} (rounds "
              + " ".join(f"{r:.3f}" for r in rs)
              + f"), ttft p50 {percentile(ttfts_of[name], 0.5) * 1e3:.1f} ms")
    loop = max(ratios, key=lambda k: statistics.median(ratios[k]))
    ratio, ttfts = statistics.median(ratios[loop]), ttfts_of[loop]
    gap_ms = {name: statistics.mean(gaps) * 1e3 if gaps else 0.0 for name, gaps in gaps_of.items()}
    print(f"RESULT e2e ratio={ratio:.3f} overlap_vs_normal={statistics.median(speedups):.3f} "
          f"ttft_p50_ms={percentile(ttfts, 0.5) * 1e3:.1f} "
          f"ttft_p99_ms={percentile(ttfts, 0.99) * 1e3:.1f} loop={loop} model={args.model} "
          f"gap_ms_normal={gap_ms['normal']:.2f} gap_ms_overlap={gap_ms['overlap']:.2f} "
          f"replay_control={statistics.median(replays):.3f}")


if __name__ == "__main__":
    main()
