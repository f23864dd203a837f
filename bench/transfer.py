"""KV transfer throughput: pdlife's backends against the raw mechanisms under them, for both
pool layouts (:mod:`kv.pool_layout`).

1. Mooncake: many requests' pages sent by :class:`kv.mooncake.MooncakeKVManager` to a decode
   process over loopback TCP, against the raw TransferEngine writing the same bytes in one batch
   write: as one contiguous region for the page-major pool (no layout can need fewer blocks), as
   one contiguous region per layer for the layer-major pool, and, for both, as contiguous blocks
   of the size pdlife cuts long runs into (``MooncakeConfig.max_block_bytes``): the TCP
   transport moves each block as one serial stream, so that is the faster of the raw writes.
   The raw writes go through pdlife's first engine (``MooncakeKVManager.engines``): one engine,
   as the baselines are defined, while the sender deals its blocks over all of its engines
   (``MooncakeConfig.engines``, ``--engines``), so the raw regions are also timed dealt over all
   of them, pdlife's resources (``all_engines_ratio``). Every engine has the sender's
   ``MooncakeConfig.tcp_lanes`` (``--tcp-lanes``), the raw writes' too. The one-region write is
   also timed on a separate engine of the same process (``second_engine_ratio``), and
   ``engine_aa``, that write on the separate engine over the same write on pdlife's first, shows
   how far two identical engines read apart in the run (the yardstick for the ratios' noise).
2. Local: :class:`kv.local.LocalKVManager` moving the same pages between two in-process pools,
   against one ``torch`` copy of the same number of bytes.

``--model`` picks the KV geometry: ``synthetic`` (the default) is Llama-3-8B-like, 32 layers,
page size 16, 8 KV heads of 128, bfloat16 (2 MiB per page over all layers); ``smollm2``,
``reference`` or a checkpoint path take the layers, KV heads, head dim and dtype of that
model's pool (``--dtype`` for a real one: SmolLM2 in float32 is 30 layers of 3 KV heads of 64,
720 KiB a page). Where the pages come from:

* ``churned`` (the RESULT line): the prefill pool's own :class:`kv.pool.PageAllocator` first
  serves ``--churn`` arrivals and departures of requests of 256 to 2,048 tokens (the prompt
  lengths of chat-like traffic; PD traces such as Mooncake's average several thousand) at up to
  75% occupancy; the measured requests are then allocated from the pool that churn left behind,
  between the pages of the requests still live.
* ``shredded`` (printed for reference): the pool's free pages are runs of ``--run-pages`` pages
  in shuffled order, and each request takes its pages from them; what a free list that does not
  keep runs together leaves after churn.

Each round sends every request once with pdlife and with each baseline, pdlife first in even
rounds and last in odd ones, so both see the same machine load and neither always follows the
other; a figure is the median over ``--iters`` rounds after a warm-up, and a ratio is the median
of the per-round ratios.

Last line, for the churned pool: ``RESULT transfer ratio=<page-major pdlife / raw one region>
layer_major_ratio=<layer-major pdlife / raw one region per layer> local_ratio=<page-major local /
torch> pdlife_gbps=<page-major pdlife> raw_gbps=<raw one region> blocks_ratio=<page-major pdlife
/ raw blocks> raw_blocks_gbps= layer_major_gbps=<layer-major pdlife> layer_major_local_ratio=
second_engine_ratio=<page-major pdlife / raw one region on a second engine>
layer_major_second_engine_ratio= engine_aa=<second engine / pdlife's engine, page-major>
layer_major_engine_aa= all_engines_ratio=<page-major pdlife / raw one region cut into a piece
per engine of the sender's> layer_major_all_engines_ratio= engines=<the sender's engines>
tcp_lanes=<each engine's TCP lanes per peer> model=<the geometry>`` (the ``all_engines`` fields
only with more than one engine). Two pools of ``--pages`` pages are live at a time (4.5 GiB at
the default 1,152 synthetic pages). ``--cuts`` compares cut sizes instead
(:mod:`bench.transfer_cuts`), ``--lanes`` TCP lanes (:mod:`bench.transfer_lanes`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Iterator

import attrs
import torch

from bench.transfer_cuts import bench_cuts
from bench.transfer_lanes import bench_lanes
from bench.transfer_plans import Plan, churned_requests, describe, shredded_requests
from bench.transfer_sliced import bench_sliced
from kv.bootstrap import BootstrapServer
from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_engine import MooncakeConfig, MooncakeEngine
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.transfer import KVManager, KVPoll, KVSender
from tests.mooncake_harness import DecodePeer

PAGE_SIZE = 16


@attrs.frozen
class Shape:
    """The KV geometry the pools are built with."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def pool(self, pages: int, layout: KVLayout = KVLayout.LAYER_MAJOR) -> KVPool:
        return KVPool(num_layers=self.num_layers, num_pages=pages, page_size=PAGE_SIZE,
                      kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                      layout=layout)

    @property
    def page_mib(self) -> float:
        """MiB of one page over every layer, K and V."""
        return self.pool(1).bytes_of_pages(1) / (1 << 20)


SYNTHETIC = Shape("synthetic", num_layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def shape_of(model: str, dtype: str) -> Shape:
    """``synthetic``, or the geometry of the pool that model ``model`` (in ``dtype``) makes."""
    if model == SYNTHETIC.name:
        return SYNTHETIC
    from bench import bench_model

    pool = bench_model(model, dtype=dtype).make_pool(num_pages=1, page_size=PAGE_SIZE)
    return Shape(model, pool.num_layers, pool.kv_heads, pool.head_dim, pool.dtype)


@attrs.frozen
class Figures:
    """Medians over the timed rounds: pdlife's GB/s, the baseline's, and their ratio; and the
    ratio of each round."""

    pdlife_gbps: float
    base_gbps: float
    ratio: float
    rounds: list[float]

    def spread(self) -> str:
        return f"{min(self.rounds):.2f}-{max(self.rounds):.2f}"


def engine_aa(figures: dict[str, Figures]) -> float:
    """The median over the rounds of the raw write on a second engine over the same write on
    pdlife's: how far apart two engines doing identical work read in this run."""
    same, second = figures["regions"].rounds, figures["second"].rounds
    return statistics.median(a / b for a, b in zip(same, second, strict=True))


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


def send_round(manager: KVManager, senders: dict[int, KVSender], metadata: MetadataBuffers,
               plan: Plan) -> float:
    """Send every request of ``plan`` once; seconds from the first send to the last SUCCESS."""
    wait_all(manager, senders, {KVPoll.WAITING_FOR_INPUT})
    start = time.perf_counter()
    for i, (room, sender) in enumerate(senders.items()):
        sender.init(len(plan[i]), i)
        metadata.write(i, first_token=1, cached_tokens=0, logprob=None, room=room)
        sender.send(plan[i], last=True)
    wait_all(manager, senders, {KVPoll.SUCCESS, KVPoll.FAILED})
    return time.perf_counter() - start


def decode_peer(server: BootstrapServer, shape: Shape, pages: int, slots: int,
                layout: KVLayout) -> DecodePeer:
    """A decode process with a pool of ``pages`` pages of ``shape`` in ``layout``."""
    return DecodePeer(server.address, layers=shape.num_layers, pages=pages, page_size=PAGE_SIZE,
                      heads=shape.kv_heads, dim=shape.head_dim,
                      dtype=str(shape.dtype).removeprefix("torch."), slots=slots,
                      layout=layout.value)


def sending(manager: MooncakeKVManager, server: BootstrapServer, peer: DecodePeer,
            metadata: MetadataBuffers, plan: Plan, rooms: Iterator[int]) -> Callable[[], float]:
    """A round of pdlife's sender: every request of ``plan`` posted at ``peer``, sent, and
    released; it returns the seconds from the first send to the last SUCCESS."""
    def round_() -> float:
        senders: dict[int, KVSender] = {}
        for pages in plan:
            room = next(rooms)
            peer.recv(room, len(pages))
            senders[room] = manager.create_sender(server.address, room)
        seconds = send_round(manager, senders, metadata, plan)
        for room, sender in senders.items():
            sender.clear()
            peer.done(room)
            peer.command(cmd="release", room=room)
        return seconds
    return round_


def timed(total: int, seconds: float) -> float:
    return total / seconds / 1e9


def measure(iters: int, total: int, pdlife: Callable[[], float],
            bases: dict[str, Callable[[], float]]) -> dict[str, Figures]:
    """Rounds of pdlife and each baseline; per baseline, medians of GB/s and of the per-round
    ratios. pdlife goes first in even rounds and last in odd ones (the baselines in reverse),
    so neither side always runs in the other's wake and a drift in the machine's load favours
    neither."""
    ours: list[float] = []
    theirs: dict[str, list[float]] = {name: [] for name in bases}
    for it in range(iters + 1):  # the first round warms up
        b: dict[str, float] = {}
        if it % 2:
            b = {name: timed(total, bases[name]()) for name in reversed(bases)}
        a = timed(total, pdlife())
        if not it % 2:
            b = {name: timed(total, base()) for name, base in bases.items()}
        if it:
            ours.append(a)
            for name in bases:
                theirs[name].append(b[name])
    figures = {}
    for name, gbps in theirs.items():
        ratios = [a / b for a, b in zip(ours, gbps, strict=True)]
        figures[name] = Figures(statistics.median(ours), statistics.median(gbps),
                                statistics.median(ratios), ratios)
    return figures


#: How a plan's rounds are timed, given the live manager, the bytes of a round, pdlife's round
#: and the baselines' (:func:`measure` by default; :mod:`bench.transfer_cuts` varies the cut).
Rounds = Callable[[MooncakeKVManager, int, Callable[[], float], dict[str, Callable[[], float]]],
                  dict[str, Figures]]


def bench_mooncake(args: argparse.Namespace, plans: dict[str, Plan], shape: Shape,
                   layout: KVLayout, rounds: Rounds | None = None) -> dict[str, dict[str, Figures]]:
    """Per plan, pdlife against the raw engine writing the same bytes as ``regions`` (one region,
    or one per layer) and as ``blocks`` (contiguous blocks of pdlife's ``max_block_bytes``)."""
    server = BootstrapServer()
    pool = shape.pool(args.pages, layout)
    pool.buffer.view(torch.int16).random_()
    slots = max(len(plan) for plan in plans.values())
    metadata = MetadataBuffers(slots)
    manager = MooncakeKVManager(pool, metadata, config=MooncakeConfig(
        engines=args.engines, tcp_lanes=args.tcp_lanes))
    manager.register_to_bootstrap(server.address)
    peer = decode_peer(server, shape, args.pages, slots, layout)
    # A separate engine writing the same regions: the control that shows how far two engines
    # differ on the same write (``engine_aa``), and the ratio against it.
    second = MooncakeEngine(manager.config)
    base = pool.buffer.data_ptr()
    second.register(base, pool.buffer.numel() * pool.buffer.element_size())
    # The baseline's regions: the whole buffer as one, or one per layer (K and V together).
    regions = 1 if layout is KVLayout.PAGE_MAJOR else pool.num_layers
    stride = pool.buffer.numel() * pool.buffer.element_size() // regions
    rooms = itertools.count(1)
    results: dict[str, dict[str, Figures]] = {}
    try:
        session = peer.info["session"]
        # pdlife's flow control: writes of at most half the blocks in flight, the oldest waited
        # for once more would be in flight. (One write of some 1,800 blocks at once made the
        # peer's engine reject some of them as outside its registered memory, and fail every
        # write after: seen with Mooncake 0.3.13.post1.)
        step = max(1, manager.config.max_blocks_in_flight // 2)

        def raw(engines: tuple[MooncakeEngine, ...], src: list[int], dst: list[int],
                lens: list[int]) -> Callable[[], float]:
            """The blocks written as pdlife's pipeline writes: parts of half the blocks in
            flight, each part's blocks dealt over ``engines`` in turn."""
            def write() -> float:
                start = time.perf_counter()
                batches: list[tuple[MooncakeEngine, int, int]] = []
                for at in range(0, len(src), step):
                    while batches and sum(n for _, _, n in batches) + step > 2 * step:
                        wait_batch(*batches.pop(0)[:2])
                    part = range(at, min(at + step, len(src)))
                    n = min(len(engines), len(part))
                    for k, engine in enumerate(engines[:n]):
                        mine = part[k::n]
                        batch = engine.submit_write(session, [src[i] for i in mine],
                                                    [dst[i] for i in mine],
                                                    [lens[i] for i in mine])
                        if not batch:
                            raise SystemExit("the raw engine refused a write")
                        batches.append((engine, batch, len(mine)))
                for engine, batch, _ in batches:
                    wait_batch(engine, batch)
                return time.perf_counter() - start
            return write

        def wait_batch(engine: MooncakeEngine, batch: int) -> None:
            rc = engine.wait(batch)
            if rc != 0:
                raise SystemExit(f"raw engine write failed: rc={rc}")

        peer_base = peer.info["kv_ptr"]
        for name, plan in plans.items():
            total = pool.bytes_of_pages(sum(len(p) for p in plan))
            block = manager.config.max_block_bytes
            pieces = range(0, total, block)
            src = [base + i * stride for i in range(regions)]
            dst = [peer_base + i * stride for i in range(regions)]
            lens = [total // regions] * regions
            first = manager.engines[:1]
            bases = {
                "regions": raw(first, src, dst, lens),
                "blocks": raw(first, [base + at for at in pieces],
                              [peer_base + at for at in pieces],
                              [min(block, total - at) for at in pieces]),
                "second": raw((second,), src, dst, lens),
            }
            if len(manager.engines) > 1:
                # The same regions over every engine of the sender (one region is cut into a
                # contiguous piece per engine): the raw write with pdlife's resources.
                cut = len(manager.engines) if regions == 1 else 1
                piece = total // cut
                bases["all"] = raw(
                    manager.engines,
                    [a + j * piece for a in src for j in range(cut)],
                    [a + j * piece for a in dst for j in range(cut)],
                    [piece if j < cut - 1 else total // regions - j * piece
                     for _ in src for j in range(cut)])

            ours = sending(manager, server, peer, metadata, plan, rooms)
            results[name] = (rounds(manager, total, ours, bases) if rounds
                             else measure(args.iters, total, ours, bases))
    finally:
        second.close()
        peer.close()
        manager.close()
        server.close()
    return results


def bench_local(args: argparse.Namespace, plans: dict[str, Plan], shape: Shape,
                layout: KVLayout) -> dict[str, Figures]:
    hub = LocalTransferHub()
    src_pool = shape.pool(args.pages, layout)
    src_pool.buffer.view(torch.int16).random_()
    dst_pool = shape.pool(args.pages, layout)
    slots = max(len(plan) for plan in plans.values())
    metadata, dst_metadata = MetadataBuffers(slots), MetadataBuffers(slots)
    manager = LocalKVManager(src_pool, metadata, hub=hub, bootstrap_addr="local:bench")
    decode = LocalDecodeManager(dst_pool, dst_metadata, hub=hub)
    next_room = 1
    results: dict[str, Figures] = {}
    try:
        for name, plan in plans.items():
            total = src_pool.bytes_of_pages(sum(len(p) for p in plan))
            flat_src = src_pool.buffer.view(-1).view(torch.uint8)[:total]
            flat_dst = dst_pool.buffer.view(-1).view(torch.uint8)[:total]

            def copy(flat_src: torch.Tensor = flat_src, flat_dst: torch.Tensor = flat_dst
                     ) -> float:
                start = time.perf_counter()
                flat_dst.copy_(flat_src)
                return time.perf_counter() - start

            def ours(plan: Plan = plan) -> float:
                nonlocal next_room
                senders: dict[int, KVSender] = {}
                receivers = []
                for i, pages in enumerate(plan):
                    room = next_room + i
                    senders[room] = manager.create_sender("local:bench", room)
                    dst_pages = dst_pool.allocator.alloc(len(pages))
                    assert dst_pages is not None
                    rx = decode.create_receiver("local:bench", room)
                    rx.init()
                    rx.send_metadata(dst_pages, i)
                    receivers.append((rx, dst_pages))
                next_room += len(plan)
                seconds = send_round(manager, senders, metadata, plan)
                for sender in senders.values():
                    sender.clear()
                for slot, (rx, pages) in enumerate(receivers):
                    rx.clear()
                    dst_pool.allocator.free(pages)
                    dst_metadata.clear(slot)
                return seconds

            results[name] = measure(args.iters, total, ours, {"copy": copy})["copy"]
    finally:
        manager.close()
        decode.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SYNTHETIC.name,
                    help="the KV geometry: synthetic (default: 32 layers, 8 KV heads of 128, "
                         "bfloat16), or a model's: smollm2, reference, a checkpoint path")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="a real model's KV dtype (default: float32)")
    ap.add_argument("--pages", type=int, default=1152,
                    help="pages per pool (2 MiB each on the synthetic geometry; default: "
                         "%(default)s)")
    ap.add_argument("--requests", type=int, default=10,
                    help="requests per churned round (default: %(default)s)")
    ap.add_argument("--min-pages", type=int, default=16,
                    help="smallest request, pages of 16 tokens (default: %(default)s)")
    ap.add_argument("--max-pages", type=int, default=128,
                    help="largest request, pages (default: %(default)s)")
    ap.add_argument("--churn", type=int, default=2000,
                    help="arrivals before the measured ones (default: %(default)s)")
    ap.add_argument("--shredded-requests", type=int, default=16,
                    help="requests of the shredded round, printed for reference "
                         "(default: %(default)s)")
    ap.add_argument("--shredded-pages", type=int, default=4,
                    help="pages per shredded request (default: %(default)s)")
    ap.add_argument("--run-pages", type=int, default=4,
                    help="free run length when shredded, pages (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=9,
                    help="timed rounds, at least 5 (default: %(default)s)")
    ap.add_argument("--engines", type=int, default=MooncakeConfig().engines,
                    help="the sender's transfer engines (MooncakeConfig.engines; default: "
                         "%(default)s)")
    ap.add_argument("--tcp-lanes", type=int, default=MooncakeConfig().tcp_lanes,
                    help="TCP connections per decode peer of each engine (MooncakeConfig."
                         "tcp_lanes; default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the churn and of the requests' sizes (default: %(default)s)")
    ap.add_argument("--prefill-tp", type=int, default=1,
                    help="with --decode-tp: head slicing against whole pages (transfer_sliced; "
                         "default: %(default)s, no slicing)")
    ap.add_argument("--decode-tp", type=int, default=1,
                    help="with --prefill-tp: the decode side's TP size (transfer_sliced; default: "
                         "%(default)s)")
    ap.add_argument("--cuts",
                    help="MiB,MiB,...: the sender's cut sizes compared (transfer_cuts; no "
                         "RESULT line; default: none, the transfer benchmark)")
    ap.add_argument("--lanes", help="N,N,...: the sender's TCP lanes compared (transfer_lanes; no "
                         "RESULT line; default: none, the transfer benchmark)")
    args = ap.parse_args()
    if args.iters < 5:
        ap.error("--iters must be at least 5: the figures are medians of the rounds")
    shape = shape_of(args.model, args.dtype)
    if (args.prefill_tp, args.decode_tp) != (1, 1):
        bench_sliced(args, shape)
        return
    if args.cuts:
        bench_cuts(args, shape, [int(mib) for mib in args.cuts.split(",")])
        return
    if args.lanes:
        bench_lanes(args, shape, [int(n) for n in args.lanes.split(",")])
        return
    plans = {
        "churned": churned_requests(args.pages, args.requests, args.min_pages, args.max_pages,
                                    args.churn, args.seed),
        "shredded": shredded_requests(args.pages, args.shredded_requests, args.shredded_pages,
                                      args.run_pages, args.seed),
    }
    print(f"geometry {shape.name}: {shape.num_layers} layers, {shape.kv_heads} KV heads of "
          f"{shape.head_dim}, {str(shape.dtype).removeprefix('torch.')}, page size {PAGE_SIZE} "
          f"({shape.page_mib:.2f} MiB a page)")
    for name, plan in plans.items():
        print(describe(name, plan, args.pages, shape.page_mib, shape.num_layers))
    mooncake: dict[KVLayout, dict[str, dict[str, Figures]]] = {}
    local: dict[KVLayout, dict[str, Figures]] = {}
    for layout in (KVLayout.PAGE_MAJOR, KVLayout.LAYER_MAJOR):
        mooncake[layout] = bench_mooncake(args, plans, shape, layout)
        local[layout] = bench_local(args, plans, shape, layout)
    block_mib = MooncakeConfig().max_block_bytes / (1 << 20)
    for name in plans:
        print(f"{name}:")
        for layout, raw_name in ((KVLayout.PAGE_MAJOR, "raw one region"),
                                 (KVLayout.LAYER_MAJOR, "raw region per layer")):
            figures = mooncake[layout][name]
            m, blocks, second = figures["regions"], figures["blocks"], figures["second"]
            lo = local[layout][name]
            print(f"  {layout.value}\n"
                  f"    mooncake  pdlife {m.pdlife_gbps:5.2f} GB/s, {raw_name} "
                  f"{m.base_gbps:5.2f} GB/s, ratio {m.ratio:.3f} (rounds {m.spread()}); "
                  f"raw {block_mib:g} MiB blocks {blocks.base_gbps:5.2f} GB/s, "
                  f"ratio {blocks.ratio:.3f}\n"
                  f"              {raw_name} on a second engine {second.base_gbps:5.2f} GB/s, "
                  f"ratio {second.ratio:.3f}; second engine / pdlife's engine, same write "
                  f"{engine_aa(figures):.3f}\n"
                  + (f"              {raw_name} over pdlife's {args.engines} engines "
                     f"{figures['all'].base_gbps:5.2f} GB/s, ratio {figures['all'].ratio:.3f}\n"
                     if "all" in figures else "") +
                  f"    local     pdlife {lo.pdlife_gbps:5.2f} GB/s, torch copy "
                  f"{lo.base_gbps:5.2f} GB/s, ratio {lo.ratio:.3f} (rounds {lo.spread()})")
    page = mooncake[KVLayout.PAGE_MAJOR]["churned"]
    layer_all = mooncake[KVLayout.LAYER_MAJOR]["churned"]
    layer = layer_all["regions"]
    print(f"RESULT transfer ratio={page['regions'].ratio:.3f} "
          f"layer_major_ratio={layer.ratio:.3f} "
          f"local_ratio={local[KVLayout.PAGE_MAJOR]['churned'].ratio:.3f} "
          f"pdlife_gbps={page['regions'].pdlife_gbps:.3f} raw_gbps={page['regions'].base_gbps:.3f} "
          f"blocks_ratio={page['blocks'].ratio:.3f} raw_blocks_gbps={page['blocks'].base_gbps:.3f} "
          f"layer_major_gbps={layer.pdlife_gbps:.3f} "
          f"layer_major_local_ratio={local[KVLayout.LAYER_MAJOR]['churned'].ratio:.3f} "
          f"second_engine_ratio={page['second'].ratio:.3f} "
          f"layer_major_second_engine_ratio={layer_all['second'].ratio:.3f} "
          f"engine_aa={engine_aa(page):.3f} layer_major_engine_aa={engine_aa(layer_all):.3f} "
          + (f"all_engines_ratio={page['all'].ratio:.3f} "
             f"layer_major_all_engines_ratio={layer_all['all'].ratio:.3f} "
             if "all" in page else "")
          + f"engines={args.engines} tcp_lanes={args.tcp_lanes} model={shape.name}")


if __name__ == "__main__":
    main()
