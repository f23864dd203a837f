"""Embed the pdlife prefill scheduler in your own code: the smallest complete example.

Your service brings a model runner (here a toy one) and a KV transfer backend (here the fake
backend, which follows the transfer protocol but moves no data, so no decode server is needed).
The scheduler does the rest: bootstrap, batching, chunked prefill, transfer, failures, aborts,
one answer per request, metrics. This script drives it from its own thread, submits five
requests and prints what each got: two that succeed (one short, one long enough to be computed
in chunks), one the client aborts, one whose transfer fails and one too long for the pool.

    python examples/embed_minimal.py

docs/embedding.md walks through it. Exit status 1 if a first token is wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kv.fake import FakeKVManager, FaultPlan
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from scheduler.messages import FAKE_BOOTSTRAP_HOST, NewRequest, Response
from scheduler.prefill import PrefillScheduler, SchedulerConfig
from scheduler.runner import ForwardBatch


def checksum(tokens: Sequence[int]) -> int:
    """The toy model's answer: a position-weighted checksum of the whole prefix."""
    return sum((i + 1) * t for i, t in enumerate(tokens)) % 256


class ChecksumRunner:
    """A stand-in for your model, implementing :class:`scheduler.runner.ModelRunner`.

    The contract: write the K/V of every item's tokens into ``pool`` (position ``p`` lives in page
    ``item.pages[p // page_size]`` at offset ``p % page_size``) and return, per item, the next
    token after its last input token. An item may be a later chunk of a long prompt
    (``item.start > 0``): the earlier positions are already in the pool. This toy stores each
    token id as its key and answers the checksum of the whole prefix *read back from the pool*,
    so a chunked prompt only comes out right if every chunk landed where the page table says.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def forward(self, batch: ForwardBatch) -> list[int]:
        ps = self.pool.page_size
        keys = self.pool.k(0)  # [pages, page_size, kv_heads, head_dim] of layer 0
        out = []
        for item in batch.items:
            for pos, token in enumerate(item.input_ids, start=item.start):
                keys[item.pages[pos // ps], pos % ps] = float(token)
            end = item.start + len(item.input_ids)
            prefix = [int(keys[item.pages[p // ps], p % ps, 0, 0]) for p in range(end)]
            out.append(checksum(prefix))
        return out


def main() -> int:
    config = SchedulerConfig(
        page_size=4,
        chunked_prefill_size=8,  # prompts longer than 8 tokens are computed in chunks
        max_prefill_tokens=32,
        check_invariants=True,  # check the lifecycle after every event (tests, debugging)
    )
    pool = KVPool(num_layers=1, num_pages=64, page_size=4, kv_heads=1, head_dim=1)
    answers: dict[str, Response] = {}
    scheduler = PrefillScheduler(
        config=config,
        runner=ChecksumRunner(pool),
        kv=FakeKVManager(),  # your backend: LocalKVManager, MooncakeKVManager, ...
        # Requests for bootstrap host 2.2.2.2 (warm-up, health) use this one; here every
        # transfer on it fails, to show a failure.
        fake_kv=FakeKVManager(FaultPlan(seed=0, transfer_failure=1.0)),
        metadata=MetadataBuffers(8),
        slots=SlotAllocator(8),
        on_response=lambda r: answers.__setitem__(r.rid, r),
    )
    prompts = {
        "short": list(range(1, 7)),
        "chunked": list(range(10, 40)),  # 30 tokens: four chunks of at most 8
        "aborted": list(range(5, 20)),
        "doomed": list(range(3, 9)),  # goes to 2.2.2.2, whose transfers fail
        "too-long": [7] * 300,  # more than the pool's 256 token slots: rejected at once
    }
    for room, (rid, prompt) in enumerate(prompts.items(), start=1):
        host = FAKE_BOOTSTRAP_HOST if rid == "doomed" else "decode-0.example"
        scheduler.submit(NewRequest(rid, prompt, bootstrap_host=host, bootstrap_room=room))
    scheduler.abort("aborted")  # thread-safe, like submit; takes effect on the next pass

    # One thread steps the scheduler; submit() and abort() may come from any thread.
    scheduler.run_until(lambda: len(answers) == len(prompts), timeout=30)
    scheduler.check_invariants()  # conservation of pages and slots, the state index
    scheduler.close()

    wrong = 0
    for rid, prompt in prompts.items():
        r = answers[rid]
        reason = r.reason.value if r.reason else "-"
        line = f"{rid:9} {r.state.name:7} reason={reason:16} http={r.http_status}"
        if r.ok:
            expected = checksum(prompt)
            wrong += r.first_token != expected
            line += f" first_token={r.first_token} (expected {expected})"
        print(line)
    registry = scheduler.metrics.registry
    tokens = registry.get_sample_value("pdlife_prefill_tokens_total")
    batches = registry.get_sample_value("pdlife_prefill_batches_total")
    print(f"prefill tokens computed: {tokens:.0f} in {batches:.0f} batches")
    print("ok" if not wrong else f"{wrong} wrong first tokens")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
