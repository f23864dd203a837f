"""KV transfer throughput: pdlife's backends against the raw mechanisms under them.

1. Mooncake: many requests' pages, scattered in the prefill pool, sent by
   :class:`kv.mooncake.MooncakeKVManager` to a decode process over loopback TCP, against the raw
   TransferEngine writing the same bytes as one contiguous region per layer (one batch write).
2. Local: :class:`kv.local.LocalKVManager` moving the same pages between two in-process pools,
   against one ``torch`` copy of the same number of bytes.

Geometry is Llama-3-8B-like: 32 layers, page size 16, 8 KV heads of 128, bfloat16 (2 MiB per
page over all layers). The prefill pool is fragmented into free runs of ``--run-pages`` pages
(what a page allocator holds after churn); requests take their pages from those runs in a
shuffled order. Each figure is the median of ``--iters`` timed rounds after a warm-up.

Last line: ``RESULT transfer ratio=<pdlife/raw> pdlife_gbps= raw_gbps= local_ratio=<local/torch>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kv.bootstrap import BootstrapServer
from kv.local import LocalDecodeManager, LocalKVManager, LocalTransferHub
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.pool import KVPool
from kv.transfer import KVManager, KVPoll, KVSender
from tests.mooncake_harness import DecodePeer

GEOMETRY = {"num_layers": 32, "page_size": 16, "kv_heads": 8, "head_dim": 128}
DTYPE = torch.bfloat16


def scattered_requests(num_pages: int, requests: int, pages_each: int, run_pages: int,
                       seed: int) -> list[list[int]]:
    """Page lists for ``requests`` requests, drawn from free runs of ``run_pages`` pages."""
    runs = [list(range(s, min(s + run_pages, num_pages))) for s in range(0, num_pages, run_pages)]
    random.Random(seed).shuffle(runs)
    free = [p for run in runs for p in run]
    need = requests * pages_each
    if need > len(free):
        raise SystemExit(f"pool of {num_pages} pages cannot hold {need}")
    return [free[i * pages_each : (i + 1) * pages_each] for i in range(requests)]


def wait_all(manager: KVManager, senders: dict[int, KVSender], until: set[KVPoll]) -> None:
    pending = dict(senders)
    deadline = time.monotonic() + 60
    while pending:
        room = manager.ready.get(timeout=max(deadline - time.monotonic(), 0.001))
        sender = pending.get(room)
        if sender is not None and (state := sender.poll()) in until:
            if state == KVPoll.FAILED:
                raise SystemExit(f"room {room} failed: {sender.failure_exception()}")
            del pending[room]


def bench_mooncake(args: argparse.Namespace, plan: list[list[int]]) -> tuple[float, float]:
    server = BootstrapServer()
    pool = KVPool(num_pages=args.pages, dtype=DTYPE, **GEOMETRY)
    pool.buffer.view(torch.int16).random_()
    metadata = MetadataBuffers(len(plan))
    manager = MooncakeKVManager(pool, metadata)
    manager.register_to_bootstrap(server.address)
    peer = DecodePeer(server.address, layers=GEOMETRY["num_layers"], pages=args.pages,
                      page_size=GEOMETRY["page_size"], heads=GEOMETRY["kv_heads"],
                      dim=GEOMETRY["head_dim"], dtype="bfloat16", slots=len(plan))
    total = sum(len(p) for p in plan) * pool.page_bytes * 2 * pool.num_layers
    # The raw engine writes the same bytes as one contiguous region per layer, one batch write.
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    base = pool.buffer.data_ptr()
    engine.register_memory(base, pool.buffer.numel() * pool.buffer.element_size())
    layer_stride = 2 * pool.num_pages * pool.page_bytes
    src = [base + layer * layer_stride for layer in range(pool.num_layers)]
    lens = [total // pool.num_layers] * pool.num_layers
    pdlife: list[float] = []
    raw: list[float] = []
    room = 1
    try:
        dst = [peer.info["kv_ptr"] + layer * layer_stride for layer in range(pool.num_layers)]
        # Rounds alternate between the two, so both see the same machine load.
        for it in range(args.iters + 1):
            start = time.perf_counter()
            rc = engine.batch_transfer_sync_write(peer.info["session"], src, dst, lens)
            if rc != 0:
                raise SystemExit(f"raw engine write failed: rc={rc}")
            if it:
                raw.append(total / (time.perf_counter() - start) / 1e9)

            senders: dict[int, KVSender] = {}
            for i in range(len(plan)):
                peer.recv(room + i, len(plan[i]))
                senders[room + i] = manager.create_sender(server.address, room + i)
            wait_all(manager, senders, {KVPoll.WAITING_FOR_INPUT})
            start = time.perf_counter()
            for i, (r, sender) in enumerate(senders.items()):
                sender.init(len(plan[i]), i)
                metadata.write(i, first_token=1, cached_tokens=0, logprob=None, room=r)
                sender.send(plan[i], last=True)
            wait_all(manager, senders, {KVPoll.SUCCESS, KVPoll.FAILED})
            if it:
                pdlife.append(total / (time.perf_counter() - start) / 1e9)
            for r, sender in senders.items():
                sender.clear()
                peer.done(r)
                peer.command(cmd="release", room=r)
            room += len(plan)
        engine.unregister_memory(base)
    finally:
        peer.close()
        manager.close()
        server.close()
    print(f"mooncake: {len(plan)} requests, {total / 2**20:.0f} MiB per round, "
          f"free runs of {args.run_pages} pages")
    print(f"  pdlife  {statistics.median(pdlife):6.2f} GB/s  (rounds: "
          + " ".join(f"{x:.2f}" for x in pdlife) + ")")
    print(f"  raw     {statistics.median(raw):6.2f} GB/s  (rounds: "
          + " ".join(f"{x:.2f}" for x in raw) + ")")
    return statistics.median(pdlife), statistics.median(raw)


def bench_local(args: argparse.Namespace, plan: list[list[int]]) -> tuple[float, float]:
    hub = LocalTransferHub()
    src_pool = KVPool(num_pages=args.pages, dtype=DTYPE, **GEOMETRY)
    src_pool.buffer.view(torch.int16).random_()
    dst_pool = KVPool(num_pages=args.pages, dtype=DTYPE, **GEOMETRY)
    metadata, dst_metadata = MetadataBuffers(len(plan)), MetadataBuffers(len(plan))
    manager = LocalKVManager(src_pool, metadata, hub=hub, bootstrap_addr="local:bench")
    decode = LocalDecodeManager(dst_pool, dst_metadata, hub=hub)
    total = sum(len(p) for p in plan) * src_pool.page_bytes * 2 * src_pool.num_layers
    local: list[float] = []
    room = 1
    try:
        for it in range(args.iters + 1):
            senders: dict[int, KVSender] = {}
            receivers = []
            for i in range(len(plan)):
                senders[room + i] = manager.create_sender("local:bench", room + i)
                dst_pages = dst_pool.allocator.alloc(len(plan[i]))
                assert dst_pages is not None
                rx = decode.create_receiver("local:bench", room + i)
                rx.init()
                rx.send_metadata(dst_pages, i)
                receivers.append((rx, dst_pages))
            wait_all(manager, senders, {KVPoll.WAITING_FOR_INPUT})
            start = time.perf_counter()
            for i, (r, sender) in enumerate(senders.items()):
                sender.init(len(plan[i]), i)
                metadata.write(i, first_token=1, cached_tokens=0, logprob=None, room=r)
                sender.send(plan[i], last=True)
            wait_all(manager, senders, {KVPoll.SUCCESS, KVPoll.FAILED})
            if it:
                local.append(total / (time.perf_counter() - start) / 1e9)
            for sender in senders.values():
                sender.clear()
            for slot, (rx, pages) in enumerate(receivers):
                rx.clear()
                dst_pool.allocator.free(pages)
                dst_metadata.clear(slot)
            room += len(plan)
    finally:
        manager.close()
        decode.close()
    flat_src = src_pool.buffer.view(-1).view(torch.uint8)[:total]
    flat_dst = dst_pool.buffer.view(-1).view(torch.uint8)[:total]
    copy: list[float] = []
    for it in range(args.iters + 1):
        start = time.perf_counter()
        flat_dst.copy_(flat_src)
        if it:
            copy.append(total / (time.perf_counter() - start) / 1e9)
    print(f"local: {total / 2**20:.0f} MiB per round")
    print(f"  pdlife  {statistics.median(local):6.2f} GB/s")
    print(f"  torch   {statistics.median(copy):6.2f} GB/s  (one contiguous copy_)")
    return statistics.median(local), statistics.median(copy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=96, help="pages per pool (2 MiB each)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--pages-per-request", type=int, default=4)
    ap.add_argument("--run-pages", type=int, default=4, help="length of the pool's free runs")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    plan = scattered_requests(args.pages, args.requests, args.pages_per_request, args.run_pages,
                              args.seed)
    pdlife, raw = bench_mooncake(args, plan)
    local, copy = bench_local(args, plan)
    print(f"RESULT transfer ratio={pdlife / raw:.3f} pdlife_gbps={pdlife:.3f} raw_gbps={raw:.3f} "
          f"local_ratio={local / copy:.3f}")


if __name__ == "__main__":
    main()
