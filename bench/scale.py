"""Per-pass scheduler overhead with 100 versus 10,000 and 100,000 requests waiting in bootstrap,
and what each waiting request costs in memory.

The forward is excluded (a runner that returns at once), so what is timed is the pass itself.
Each measured pass admits one flowing request (handshake instant, transfer instant) while N
requests sit in BOOTSTRAPPING whose decode peer never answers. pdlife's pass touches what
changed (readiness is pushed, deadlines are a heap), so its cost should not grow with N. The
baseline, measured side by side, is SGLang's bootstrap queue: every pass polls every queued
sender. Rounds alternate between the sizes so that load on a shared machine falls on all of
them; each size keeps its best round.

Memory per waiting request is measured twice at the largest N: the process's resident set
before and after the scheduler that is timed is built (what the machine pays, allocator slack
included), and the Python heap that ``tracemalloc`` traces over a second build (the request
record, its admission entries and deadline, and the fake KV sender). Both are divided by N.

Last line: ``RESULT scale ratio=<worst of the two ratios> ratio_10000=<cost(10,000) ÷ cost(100)>
ratio_100000=<cost(100,000) ÷ cost(100)> us_per_pass_100=.. us_per_pass_10000=..
us_per_pass_100000=.. bytes_per_waiting=<tracemalloc> rss_bytes_per_waiting=<RSS delta>``
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from pathlib import Path

from kv.fake import FakeKVManager, FaultPlan
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from kv.transfer import KVPoll
from scheduler.messages import FAKE_BOOTSTRAP_HOST, NewRequest
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch

BASE = 100
SIZES = (BASE, 10_000, 100_000)
#: Far beyond the bench's runtime, so that no waiting request times out while it is measured.
BOOTSTRAP_TIMEOUT_S = 3600.0


class InstantRunner:
    """The forward excluded: every item's next token is 0."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def forward(self, batch: ForwardBatch) -> list[int]:
        return [0] * len(batch.items)


def build(waiting: int) -> PrefillScheduler:
    pool = KVPool(num_layers=1, num_pages=4096, page_size=16, kv_heads=1, head_dim=8)
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=16, bootstrap_timeout=BOOTSTRAP_TIMEOUT_S),
        runner=InstantRunner(pool),
        kv=FakeKVManager(FaultPlan(bootstrap_timeout=1.0)),  # the decode peer never answers
        fake_kv=FakeKVManager(),
        metadata=MetadataBuffers(64),
        slots=SlotAllocator(64),
    )
    for i in range(waiting):
        sched.submit(NewRequest(f"stuck{i}", (1, 2, 3), bootstrap_host="decode",
                                bootstrap_room=i + 1))
    sched.step()
    assert len(sched.lifecycle) == waiting
    return sched


def rss_bytes() -> int:
    """The process's resident set now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def build_measuring_rss(waiting: int) -> tuple[PrefillScheduler, float]:
    """The scheduler, and the resident bytes its build added per waiting request."""
    gc.collect()
    before = rss_bytes()
    sched = build(waiting)
    gc.collect()
    return sched, (rss_bytes() - before) / waiting


def traced_bytes_per_waiting(waiting: int) -> float:
    """Python heap per waiting request, over a build of its own that is then dropped."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sched = build(waiting)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del sched
    gc.collect()
    return (after - before) / waiting


def time_passes(sched: PrefillScheduler, passes: int, poll_all: bool) -> float:
    """Seconds per pass, each admitting one flowing request."""
    stuck = [r for r in sched.lifecycle.live() if r.rid.startswith("stuck")]
    start = time.perf_counter()
    for i in range(passes):
        sched.submit(NewRequest(f"flow{i}", (1, 2, 3, 4), bootstrap_host=FAKE_BOOTSTRAP_HOST,
                                bootstrap_room=10**9 + i))
        if poll_all:
            # SGLang's bootstrap queue: poll every queued sender, every pass.
            for req in stuck:
                assert req.sender.poll() == KVPoll.BOOTSTRAPPING  # type: ignore[attr-defined]
        sched.step()
    return (time.perf_counter() - start) / passes


def passes_for(mode: str, waiting: int, passes: int) -> int:
    """The baseline's pass grows with N: fewer of them keep its round about as long as at 100."""
    return passes if mode == "pdlife" else max(10, passes * BASE // waiting)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=500,
                    help="pdlife's scheduler passes per round (the baseline's shrink as its "
                         "pass grows; default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=15,
                    help="rounds; the best pass time of each size counts (default: %(default)s)")
    args = ap.parse_args()
    largest = SIZES[-1]
    scheds = {n: build(n) for n in SIZES[:-1]}
    scheds[largest], rss_per_waiting = build_measuring_rss(largest)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for mode in ("pdlife", "poll-all"):
            for n, sched in scheds.items():
                passes = passes_for(mode, n, args.passes)
                t = time_passes(sched, passes, poll_all=mode == "poll-all")
                best[(mode, n)] = min(best.get((mode, n), t), t)
    for n, sched in scheds.items():
        stuck = sum(r.rid.startswith("stuck") for r in sched.lifecycle.live())
        assert stuck == n, f"{n - stuck} of {n} waiting requests left bootstrap"
    del scheds, sched  # the timed schedulers go before the traced build
    traced_per_waiting = traced_bytes_per_waiting(largest)
    for mode in ("pdlife", "poll-all"):
        base = best[(mode, BASE)]
        print(f"{mode:9s} us/pass: " + "   ".join(
            f"{n:,} waiting {best[(mode, n)] * 1e6:8.1f} (x{best[(mode, n)] / base:5.2f})"
            for n in SIZES))
    print(f"memory per waiting request at {largest:,}: {traced_per_waiting:,.0f} B traced "
          f"(tracemalloc), {rss_per_waiting:,.0f} B resident (RSS delta)")
    us = {n: best[("pdlife", n)] * 1e6 for n in SIZES}
    ratios = {n: us[n] / us[BASE] for n in SIZES[1:]}
    print(f"RESULT scale ratio={max(ratios.values()):.3f} "
          + " ".join(f"ratio_{n}={r:.3f}" for n, r in ratios.items()) + " "
          + " ".join(f"us_per_pass_{n}={u:.1f}" for n, u in us.items())
          + f" bytes_per_waiting={traced_per_waiting:.0f}"
          f" rss_bytes_per_waiting={rss_per_waiting:.0f}")


if __name__ == "__main__":
    main()
