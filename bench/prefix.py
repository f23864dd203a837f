"""Prefix cache: requests sharing a system prompt, with the prefix cache and without it.

64 requests share a 1,024-token system prompt, each followed by its own 64-token question. All
of them are submitted at once to :class:`~scheduler.embedded.EmbeddedPair` (the prefill
scheduler and its decode peer in this process, over the local backend: every page of every
prompt, cached or not, is copied into the decode pool), asking for one output token. With the
cache (``lpm``, as SGLang's default with RadixAttention) the first request computes the system
prompt and the others find it cached; without it (``--disable-radix-cache``) every request
computes all 1,088 tokens. The two runs alternate in this process; a figure is the median of
its rounds. Both runs must answer every request with the same first token.

- ``speedup``: prompt tokens per second with the cache ÷ without (same prompts, so the ratio of
  the runs' wall times, first submission to the last answer);
- ``ttft_p50_ratio``: the prefill side's median time to first token (admission to the end of
  the KV transfer) without the cache ÷ with it;
- ``hit_rate``: cached prompt tokens ÷ prompt tokens, in the run with the cache.

The model is SmolLM2-135M-Instruct (``--model smollm2``, the default when the shipped GGUF is
installed; slow on a CPU: the run without the cache computes about 70,000 tokens), otherwise
the fixed-point reference model. Last line: ``RESULT prefix speedup=<> ttft_p50_ratio=<>
hit_rate=<> model=<name>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence

import attrs
import torch

from bench import bench_model
from bench.e2e import serve_once
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.select import REFERENCE, ServedModel
from scheduler.model.shipped import ShippedModelMissing, shipped_path
from scheduler.prefill.config import SchedulerConfig

TEXT = (
    "You are a careful assistant for a public library. Answer questions about opening hours, "
    "borrowing rules, fines, rooms that can be booked, the archive of local newspapers, and "
    "events for children and adults. Be brief and friendly; when you do not know, say so and "
    "point the reader to the front desk. Books may be borrowed for three weeks and renewed "
    "twice unless someone has reserved them; films for one week. The reading room is quiet. "
)
WAIT_S = 7200.0  # every deadline of a run
WORDS = ("when", "can", "I", "borrow", "renew", "a", "book", "film", "room", "the", "archive",
         "how", "late", "is", "open", "on", "Sunday", "fine", "for", "children", "event", "pay")


@attrs.frozen
class Run:
    seconds: float
    ttft_p50: float
    prompt_tokens: int
    cached_tokens: int
    first_tokens: dict[str, int | None]


def pick_model(name: str) -> str:
    """``auto``: SmolLM2 when its package is installed, else the reference model."""
    if name != "auto":
        return name
    try:
        shipped_path("smollm2")
    except ShippedModelMissing:
        return REFERENCE
    return "smollm2"


def workload(served: ServedModel, requests: int, system_tokens: int, question_tokens: int,
             seed: int) -> dict[str, list[int]]:
    """The shared system prompt plus a question of its own for each request (real text, cut to
    the lengths asked for)."""
    system = served.encode(TEXT * (1 + system_tokens // 50))[:system_tokens]
    rng = random.Random(seed)
    prompts = {}
    for i in range(requests):
        words = " ".join(rng.choice(WORDS) for _ in range(4 * question_tokens))
        question = served.encode(f" Question {i}: {words}?")[:question_tokens]
        prompts[f"q{i}"] = system + question
    assert len(system) == system_tokens and all(
        len(p) == system_tokens + question_tokens for p in prompts.values()
    ), "the text is too short for the lengths asked for"
    return prompts


def run(served: ServedModel, prompts: dict[str, list[int]], cache: bool, page_size: int,
        pages: int) -> Run:
    config = PairConfig(
        scheduler=SchedulerConfig(page_size=page_size, radix_cache=cache,
                                  schedule_policy="lpm" if cache else "fcfs",
                                  bootstrap_timeout=WAIT_S, transfer_timeout=WAIT_S),
        prefill_pages=pages, decode_pages=pages, metadata_slots=len(prompts),
    )
    pair = EmbeddedPair(config, served=served)
    # Without the cache, the last requests wait many minutes on a CPU (for prefill, and for the
    # decode pool to take them): longer than the default deadlines (300 s).
    pair.decode.config = attrs.evolve(pair.decode.config, waiting_timeout=WAIT_S)
    seconds, out, ttfts = serve_once(pair, prompts, timeout=WAIT_S)
    first = {rid: o.prefill.first_token for rid, o in out.items()}
    return Run(seconds, statistics.median(ttfts), sum(len(p) for p in prompts.values()),
               sum(o.prefill.cached_tokens for o in out.values()), first)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="auto",
                    help="smollm2, reference, a checkpoint path, or auto: smollm2 if installed, "
                         "else reference (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=64,
                    help="requests, each a shared system prompt and a question of its own "
                         "(default: %(default)s)")
    ap.add_argument("--system-tokens", type=int, default=1024,
                    help="tokens of the shared system prompt (default: %(default)s)")
    ap.add_argument("--question-tokens", type=int, default=64,
                    help="tokens of each request's own question (default: %(default)s)")
    ap.add_argument("--page-size", type=int, default=16,
                    help="tokens per KV page (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed rounds, with and without the cache (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the prompts' tokens (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = pick_model(args.model)
    served = bench_model(name)
    prompts = workload(served, args.requests, args.system_tokens, args.question_tokens,
                       args.seed)
    per_request = args.system_tokens + args.question_tokens
    # Room for a third of the requests at once without the cache; both runs get the same pool.
    pages = max(args.requests // 3, 1) * -(-per_request // args.page_size) + 64
    print(f"model: {name}; {len(prompts)} requests of {per_request} tokens sharing a "
          f"{args.system_tokens}-token system prompt; page size {args.page_size}, {pages} pages")
    run(served, dict(list(prompts.items())[:2]), True, args.page_size, pages)  # warm-up
    runs: dict[bool, list[Run]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for cache in (False, True):
            r = run(served, prompts, cache, args.page_size, pages)
            runs[cache].append(r)
            print(f"round {round_} {'cache   ' if cache else 'no cache'} {r.seconds:8.2f} s "
                  f"({r.prompt_tokens / r.seconds:8.0f} prompt tok/s)  ttft p50 "
                  f"{r.ttft_p50 * 1e3:9.1f} ms  cached {r.cached_tokens}/{r.prompt_tokens}",
                  flush=True)
    same = all(r.first_tokens == runs[False][0].first_tokens for r in runs[True] + runs[False])
    print(f"first tokens equal with and without the cache: {same}")
    speedup = statistics.median(
        a.seconds / b.seconds for a, b in zip(runs[False], runs[True], strict=True))
    ttft_ratio = statistics.median(
        a.ttft_p50 / b.ttft_p50 for a, b in zip(runs[False], runs[True], strict=True))
    hit_rate = statistics.median(r.cached_tokens / r.prompt_tokens for r in runs[True])
    print(f"RESULT prefix speedup={speedup:.2f} ttft_p50_ratio={ttft_ratio:.2f} "
          f"hit_rate={hit_rate:.3f} model={name}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
