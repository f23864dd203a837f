"""Soak: 10,000 requests through the embedded pair under injected faults; nothing may leak.

Requests (small prompts, the tiny model) go through :class:`~scheduler.embedded.EmbeddedPair`
over the local backend, whose pages are really copied between the two pools, in waves. Faults
are injected at the transfer boundary of the prefill side: a wrapper around the local manager
fails the senders of chosen rooms, 5% at the bootstrap (before the handshake) and 5% in the
transfer (after the first chunk was handed to the copy engine, which may still be reading it).
Another 5% of requests are aborted by the client on both sides a few passes after they were
sent, in whatever state they reached. Rooms are numbered by the pair from 1 in submission
order, which is how a fault finds its request.

The prefill side runs the prefix cache (``--disable-radix-cache`` turns it off): half the
prompts start with one of a few shared system prompts, so faults and aborts land on requests
whose pages are shared through the radix tree.

Checked at the end: every request got exactly one answer from prefill and one from decode,
both pools and both slot allocators are full again, both schedulers' invariants hold, and a
fresh request (which shares a cached system prompt) is answered with the colocated reference's
tokens. With the cache, the pages the tree still owns are not leaked as long as no request
locks them: ``leaked_pages`` counts pages neither free nor evictable cache pages, so a lock
that outlived its request counts. Last line: ``RESULT soak requests=<n> lost=<n>
duplicated=<n> leaked_pages=<n> leaked_slots=<n> seconds=<t> hit_rate=<cached ÷ prompt
tokens>``; the exit status is 1 if any count is not zero or the fresh request's tokens differ.
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kv.transfer import KVPoll, TransferError
from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.messages import Response
from scheduler.model.reference import ModelConfig, ReferenceModel
from scheduler.prefill.config import SchedulerConfig

BOOTSTRAP, TRANSFER = "bootstrap", "transfer"


class FaultySender:
    """A local sender that fails as told: at creation (bootstrap) or on its first send."""

    def __init__(self, inner: Any, kind: str, announce: Callable[[int], None]) -> None:
        self.inner, self.kind, self.room = inner, kind, inner.room
        self._announce = announce
        self.reason = ""
        if kind == BOOTSTRAP:
            self._fail("injected bootstrap failure")

    def _fail(self, reason: str) -> None:
        self.reason = reason
        self.inner.abort()  # the decode side hears of it as from any failed prefill
        self._announce(self.room)

    def init(self, num_pages: int, slot: int) -> None:
        if not self.reason:
            self.inner.init(num_pages, slot)

    def send(self, pages: Sequence[int], last: bool) -> None:
        if self.reason:
            return
        self.inner.send(pages, last)
        if self.kind == TRANSFER:
            self._fail("injected transfer failure")

    def poll(self) -> KVPoll:
        return KVPoll.FAILED if self.reason else self.inner.poll()

    def failure_exception(self) -> TransferError:
        if self.reason:
            return TransferError(self.room, self.reason, "soak")
        return self.inner.failure_exception()

    def abort(self, why: str = "") -> None:
        self.inner.abort(why)

    def clear(self) -> None:
        self.inner.clear()

    def quiescent(self) -> bool:
        return bool(self.inner.quiescent())


def inject_faults(manager: Any, faults: dict[int, str]) -> None:
    """Wrap the senders ``manager`` creates for the rooms of ``faults``. The manager itself
    stays the scheduler's (its identity keys the scheduler's room registry, its queue pushes
    readiness); only its ``create_sender`` is replaced, on this instance."""
    create = manager.create_sender

    def create_sender(bootstrap_addr: str, room: int) -> Any:
        sender = create(bootstrap_addr, room)
        kind = faults.get(room)
        return sender if kind is None else FaultySender(sender, kind, manager.ready.put)

    manager.create_sender = create_sender


def _counting(inner: Callable[[Any], None], counts: collections.Counter[str]
              ) -> Callable[[Any], None]:
    def on_response(resp: Any) -> None:
        counts[resp.rid] += 1
        if counts[resp.rid] == 1:  # the pair refuses a second answer loudly; count it here
            inner(resp)

    return on_response


def _prompt(rng: random.Random, systems: list[list[int]]) -> list[int]:
    """Half the prompts start with a shared system prompt."""
    own = [rng.randrange(256) for _ in range(rng.randrange(1, 24))]
    return (rng.choice(systems) if rng.random() < 0.5 else []) + own


def soak(requests: int, wave: int, seed: int, overlap: bool, cache: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    model = ModelConfig.tiny(seed)
    config = PairConfig(
        model=model,
        scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16, max_prefill_tokens=512,
                                  radix_cache=cache),
        prefill_pages=512, decode_pages=512, metadata_slots=64, overlap=overlap,
    )
    systems = [[rng.randrange(256) for _ in range(n)] for n in (8, 13, 16, 20)]
    pair = EmbeddedPair(config)
    faults: dict[int, str] = {}
    aborts: dict[int, list[str]] = collections.defaultdict(list)
    rids = [f"soak-{i}" for i in range(requests)]
    for i, rid in enumerate(rids):
        roll = rng.random()
        if roll < 0.05:
            faults[i + 1] = BOOTSTRAP
        elif roll < 0.10:
            faults[i + 1] = TRANSFER
        elif roll < 0.15:
            aborts[i % wave].append(rid)  # aborted after (its index in the wave) passes, capped
    inject_faults(pair.prefill_kv, faults)
    prefill_counts: collections.Counter[str] = collections.Counter()
    decode_counts: collections.Counter[str] = collections.Counter()
    pair.prefill.on_response = _counting(pair.prefill.on_response, prefill_counts)
    pair.decode.on_response = _counting(pair.decode.on_response, decode_counts)

    answered: list[Response] = []  # the prefill answers, as run_until_done hands them over
    started = time.monotonic()
    for first in range(0, requests, wave):
        batch = rids[first : first + wave]
        for rid in batch:
            pair.submit(rid, _prompt(rng, systems),
                        SamplingParams(max_new_tokens=rng.randrange(1, 4)))
        for n in range(8):  # a few passes, then the client aborts land in whatever state
            pair.step()
            for rid in (r for k in range(n * wave // 8, (n + 1) * wave // 8)
                        for r in aborts.get(k, ()) if r in batch):
                pair.abort(rid)
        answered.extend(o.prefill for o in pair.run_until_done(batch, timeout=300).values())
    seconds = time.monotonic() - started

    pair.prefill.check_invariants()
    pair.decode.check_invariants()
    prefix = pair.prefill.prefix
    cached = 0 if prefix is None else prefix.tree.evictable  # owned by the tree, unlocked
    leaked_pages = (pair.prefill_pool.allocator.in_use() - cached
                    + pair.decode_pool.allocator.in_use())
    prompt_tokens = sum(r.prompt_tokens for r in answered)
    hit_rate = sum(r.cached_tokens for r in answered) / prompt_tokens
    leaked_slots = (pair.prefill.slots.num_slots - pair.prefill.slots.available()) + (
        pair.decode.slots.num_slots - pair.decode.slots.available())
    lost = sum(1 for r in rids if not prefill_counts[r] or not decode_counts[r])
    duplicated = sum(max(0, c - 1) for c in (*prefill_counts.values(), *decode_counts.values()))
    outcomes = collections.Counter(
        "done" if r.ok else r.reason.value for r in answered
    )
    # Healthy afterwards: a fresh request gets the colocated reference's tokens.
    prompt = systems[-1] + [rng.randrange(256) for _ in range(21)]
    pair.submit("fresh", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    fresh = pair.run_until_done(["fresh"])["fresh"]
    want = ReferenceModel(pair.model).generate(prompt, 4, (), True)
    healthy = list(fresh.decode.output_ids) == want
    pair.close()
    return dict(requests=requests, lost=lost, duplicated=duplicated, leaked_pages=leaked_pages,
                leaked_slots=leaked_slots, seconds=seconds, outcomes=outcomes, healthy=healthy,
                hit_rate=hit_rate,
                injected=collections.Counter(faults.values()),
                aborted=sum(len(v) for v in aborts.values()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000,
                        help="requests through the pair (default: %(default)s)")
    parser.add_argument("--wave", type=int, default=200,
                        help="requests sent per wave (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts, the faults and the aborts "
                             "(default: %(default)s)")
    parser.add_argument("--overlap", action="store_true",
                        help="run the prefill side's overlap loop (default: the normal loop)")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="run the prefill side without the prefix cache (default: with it)")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # every injected failure is logged; the counts matter
    r = soak(args.requests, args.wave, args.seed, args.overlap, not args.disable_radix_cache)
    print(f"injected: {dict(r['injected'])}, client aborts: {r['aborted']}")
    print(f"prefill outcomes: {dict(sorted(r['outcomes'].items()))}")
    print(f"fresh request after the soak answered like the reference: {r['healthy']}")
    bad = r["lost"] or r["duplicated"] or r["leaked_pages"] or r["leaked_slots"]
    print(f"RESULT soak requests={r['requests']} lost={r['lost']} duplicated={r['duplicated']} "
          f"leaked_pages={r['leaked_pages']} leaked_slots={r['leaked_slots']} "
          f"seconds={r['seconds']:.1f} hit_rate={r['hit_rate']:.3f}")
    return 1 if bad or not r["healthy"] else 0


if __name__ == "__main__":
    sys.exit(main())
