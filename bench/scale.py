"""Per-pass scheduler overhead with 100 versus 10,000 requests waiting in bootstrap.

The forward is excluded (a runner that returns at once), so what is timed is the pass itself.
Each measured pass admits one flowing request (handshake instant, transfer instant) while N
requests sit in BOOTSTRAPPING whose decode peer never answers. pdlife's pass touches what
changed (readiness is pushed, deadlines are a heap), so its cost should not grow with N. The
baseline, measured side by side, is SGLang's bootstrap queue: every pass polls every queued
sender.

Last line: ``RESULT scale ratio=<cost(10,000) ÷ cost(100)> us_per_pass_100=.. us_per_pass_10000=..``
"""

from __future__ import annotations

import argparse
import time

from kv.fake import FakeKVManager, FaultPlan
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from kv.transfer import KVPoll
from scheduler.messages import FAKE_BOOTSTRAP_HOST, NewRequest
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch


class InstantRunner:
    """The forward excluded: every item's next token is 0."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def forward(self, batch: ForwardBatch) -> list[int]:
        return [0] * len(batch.items)


def build(waiting: int) -> PrefillScheduler:
    pool = KVPool(num_layers=1, num_pages=4096, page_size=16, kv_heads=1, head_dim=8)
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=16),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    small, large = build(100), build(10_000)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for mode in ("pdlife", "poll-all"):
            for n, sched in ((100, small), (10_000, large)):
                t = time_passes(sched, args.passes, poll_all=mode == "poll-all")
                key = (mode, n)
                best[key] = min(best.get(key, t), t)
    for mode in ("pdlife", "poll-all"):
        a, b = best[(mode, 100)], best[(mode, 10_000)]
        print(f"{mode:9s} us/pass: 100 waiting {a * 1e6:8.1f}   10,000 waiting {b * 1e6:8.1f}"
              f"   ratio {b / a:6.2f}")
    a, b = best[("pdlife", 100)], best[("pdlife", 10_000)]
    print(f"RESULT scale ratio={b / a:.3f} us_per_pass_100={a * 1e6:.1f} "
          f"us_per_pass_10000={b * 1e6:.1f}")


if __name__ == "__main__":
    main()
