"""The Mooncake sender's TCP lanes per decode peer (``MooncakeConfig.tcp_lanes``) compared.

One process holds a sender per setting, over the one pool (each with its own engine, bootstrap
server and decode peer process), and they send the churned plan of :mod:`bench.transfer` in
turn, round by round (the order reversed every other round, so a drift in the machine's load
favours no setting). ``python -m bench.transfer --lanes 4,16`` prints, per layout and setting,
the median GB/s and the median of the per-round ratios to the first setting: the figures the
default was chosen from (docs/benchmarks.md, *Lanes*). No RESULT line: it compares settings, it
checks no target. The settings' engines start one after another in one process, so the
environment variable the lanes go through changes while the first engine's threads run, which
:func:`kv.mooncake_engine._apply_lanes` avoids in a serving process; a benchmark accepts it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import TYPE_CHECKING

import torch

from bench import part_of_transfer
from bench.transfer_plans import churned_requests
from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_engine import MooncakeConfig
from kv.pool_layout import KVLayout

if TYPE_CHECKING:
    from bench.transfer import Shape
    from tests.mooncake_harness import DecodePeer


def bench_lanes(args: argparse.Namespace, shape: Shape, lanes: list[int]) -> None:
    from bench.transfer import decode_peer, sending, timed

    plan = churned_requests(args.pages, args.requests, args.min_pages, args.max_pages,
                            args.churn, args.seed)
    rooms = itertools.count(1)
    print(f"geometry {shape.name}, {args.iters} rounds, {lanes} lanes, {args.engines} engine(s)")
    for layout in KVLayout:
        pool = shape.pool(args.pages, layout)
        pool.buffer.view(torch.int16).random_()
        total = pool.bytes_of_pages(sum(len(p) for p in plan))
        live: list[tuple[BootstrapServer, MooncakeKVManager, DecodePeer]] = []
        rounds = {}
        try:
            for n in lanes:
                server = BootstrapServer()
                metadata = MetadataBuffers(len(plan))
                manager = MooncakeKVManager(pool, metadata, config=MooncakeConfig(
                    engines=args.engines, tcp_lanes=n))
                manager.register_to_bootstrap(server.address)
                peer = decode_peer(server, shape, args.pages, len(plan), layout)
                live.append((server, manager, peer))
                rounds[n] = sending(manager, server, peer, metadata, plan, rooms)
            gbps: dict[int, list[float]] = {n: [] for n in lanes}
            for it in range(args.iters + 1):  # the first round warms up
                for n in lanes if it % 2 else lanes[::-1]:
                    g = timed(total, rounds[n]())
                    if it:
                        gbps[n].append(g)
        finally:
            for server, manager, peer in live:
                peer.close()
                manager.close()
                server.close()
        first = gbps[lanes[0]]
        for n in lanes:
            ratios = [a / b for a, b in zip(gbps[n], first, strict=True)]
            print(f"{layout.value:11s} {n:2d} lanes: {statistics.median(gbps[n]):.2f} GB/s, "
                  f"over {lanes[0]} lanes median {statistics.median(ratios):.3f} "
                  f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    part_of_transfer("transfer_lanes",
                     "python -m bench.transfer --lanes 4,16 (the TCP lanes compared)")
