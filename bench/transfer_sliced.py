"""What head slicing costs over Mooncake: a prefill at one TP size feeding a decode at another,
against the same bytes sent as whole pages (``python -m bench.transfer --prefill-tp 2
--decode-tp 1``, and the reverse; ``--model``, ``--pages``, ``--requests``, ``--min-pages``,
``--max-pages``, ``--churn``, ``--iters`` as for the main benchmark).

Every rank of both servers runs in this process with its own transfer engine, over loopback
TCP. A round sends every request of a churned plan (:mod:`bench.transfer_plans`) from every
prefill rank; it is timed from the first send to the last room concluded on every prefill rank
(a room succeeds once all its writes completed). The sliced pair is prefill TP ``Tp`` to decode
TP ``Td``: each prefill rank writes its heads into a part of each decode page, one engine block
per token slot, layer half and page (:mod:`kv.mooncake_slices`). The baseline is prefill TP
``Tp`` to decode TP ``Tp``: the same prefill ranks write the same bytes as whole pages, one
block per run of pages (page-major) cut into ``max_block_bytes``. Rounds alternate, the sliced
pair first, so both see the same load; the figures are medians (:func:`bench.transfer.measure`).

Last line: ``RESULT transfer_sliced ratio=<sliced GB/s / whole-page GB/s> sliced_gbps=
whole_gbps= prefill_tp= decode_tp= blocks_per_page=<blocks one prefill rank writes per page,
sliced> model=``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from bench import part_of_transfer
from bench.transfer_plans import Plan, churned_requests
from kv.bootstrap import BootstrapServer
from kv.layouts import TPLayout, plan_slices
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager, MooncakeKVReceiver
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.rank_table import RankPlace
from kv.transfer import KVPoll, KVSender

if TYPE_CHECKING:
    from bench.transfer import Shape


class Pair:
    """A prefill server of ``prefill_tp`` ranks and a decode server of ``decode_tp`` ranks, each
    rank with its own engine and a page-major pool of its heads (``make_pool(heads)``)."""

    def __init__(self, make_pool: Callable[[int], KVPool], kv_heads: int, num_layers: int,
                 slots: int, prefill_tp: int, decode_tp: int) -> None:
        self.server = BootstrapServer(expected_ranks=prefill_tp)
        self.slots = slots
        self.prefill: list[MooncakeKVManager] = []
        self.decode: list[MooncakeDecodeManager] = []
        for side, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            for rank in range(tp):
                place = RankPlace(tp_rank=rank, tp_size=tp, kv_heads=kv_heads,
                                  num_layers=num_layers, layer_start=0, layer_stop=num_layers)
                pool = make_pool(place.heads_per_rank)
                if side == "prefill":
                    manager = MooncakeKVManager(pool, MetadataBuffers(slots), place=place)
                    manager.register_to_bootstrap(self.server.address)
                    self.prefill.append(manager)
                else:
                    self.decode.append(MooncakeDecodeManager(
                        pool, MetadataBuffers(slots), self.server.address, place=place))
        self._next_room = 1

    def round(self, plan: Plan) -> float:
        """Send every request of ``plan`` once from every prefill rank; seconds from the first
        send to the last room concluded."""
        rooms = range(self._next_room, self._next_room + len(plan))
        self._next_room += len(plan)
        receivers: list[MooncakeKVReceiver] = []
        dst_pages = self.decode[0].pool.allocator
        held = []
        for i, (room, pages) in enumerate(zip(rooms, plan, strict=True)):
            dst = dst_pages.alloc(len(pages))
            assert dst is not None, "the decode pools are too small for the plan"
            held.append(dst)
            for d in self.decode:  # every decode rank receives into the same page numbers
                rx = d.create_receiver(self.server.address, room)
                rx.init()
                rx.send_metadata(dst, i)
                receivers.append(rx)
        senders = [{room: m.create_sender(self.server.address, room) for room in rooms}
                   for m in self.prefill]
        for m, mine in zip(self.prefill, senders, strict=True):
            _wait(m, mine, {KVPoll.WAITING_FOR_INPUT})
        start = time.perf_counter()
        for m, mine in zip(self.prefill, senders, strict=True):
            for i, (room, sender) in enumerate(mine.items()):
                sender.init(len(plan[i]), i)
                m.metadata.write(i, first_token=1, cached_tokens=0, logprob=None, room=room)
                sender.send(plan[i], last=True)
        for m, mine in zip(self.prefill, senders, strict=True):
            _wait(m, mine, {KVPoll.SUCCESS})
        seconds = time.perf_counter() - start
        deadline = time.monotonic() + 60
        for rx in receivers:
            while rx.poll() != KVPoll.SUCCESS or not rx.quiescent():
                if time.monotonic() > deadline:
                    raise SystemExit(f"decode room {rx.room} did not complete")
                time.sleep(0.001)
            rx.clear()
        for mine in senders:
            for sender in mine.values():
                sender.clear()
        for pages in held:
            dst_pages.free(pages)
        for d in self.decode:
            for slot in range(len(plan)):
                d.metadata.clear(slot)
        return seconds

    def close(self) -> None:
        for d in self.decode:
            d.close()
        for p in self.prefill:
            p.close()
        self.server.close()


def _wait(manager: MooncakeKVManager, senders: Mapping[int, KVSender],
          until: set[KVPoll]) -> None:
    pending = dict(senders)
    deadline = time.monotonic() + 120
    while pending:
        room = manager.ready.get(timeout=max(deadline - time.monotonic(), 0.001))
        sender = pending.get(room)
        if sender is None:
            continue
        state = sender.poll()
        if state == KVPoll.FAILED:
            raise SystemExit(f"room {room} failed: {sender.failure_exception()}")
        if state in until:
            del pending[room]


def bench_sliced(args: argparse.Namespace, shape: Shape) -> None:
    """Run the sliced pair against the whole-page pair and print the figures and RESULT."""
    from bench.transfer import PAGE_SIZE, measure

    def make_pool(heads: int) -> KVPool:
        pool = KVPool(num_layers=shape.num_layers, num_pages=args.pages, page_size=PAGE_SIZE,
                      kv_heads=heads, head_dim=shape.head_dim, dtype=shape.dtype,
                      layout=KVLayout.PAGE_MAJOR)
        pool.buffer.view(torch.int16).random_()
        return pool

    tp, td = args.prefill_tp, args.decode_tp
    layers = shape.num_layers
    plan = churned_requests(args.pages, args.requests, args.min_pages, args.max_pages,
                            args.churn, args.seed)
    pages = sum(len(p) for p in plan)
    total = shape.pool(1).bytes_of_pages(pages)  # every head of every page, all prefill ranks
    slices = plan_slices(TPLayout(tp, shape.kv_heads), TPLayout(td, shape.kv_heads))
    whole_pages = slices.whole_pages(0, slices.destinations(0)[0])
    per_page = 1 if whole_pages else len(slices.sends(0)) * layers * 2 * PAGE_SIZE
    print(f"sliced: prefill TP {tp} -> decode TP {td}, {len(plan)} requests, {pages} pages "
          f"({total / (1 << 20):.0f} MiB per round), {per_page} blocks per page per prefill "
          f"rank; baseline: prefill TP {tp} -> decode TP {tp}, whole pages")
    sliced = Pair(make_pool, shape.kv_heads, layers, len(plan), tp, td)
    whole = Pair(make_pool, shape.kv_heads, layers, len(plan), tp, tp)
    try:
        figures = measure(args.iters, total, lambda: sliced.round(plan),
                          {"whole": lambda: whole.round(plan)})["whole"]
    finally:
        sliced.close()
        whole.close()
    print(f"  sliced {figures.pdlife_gbps:6.3f} GB/s, whole pages {figures.base_gbps:6.3f} GB/s, "
          f"ratio {figures.ratio:.3f} (rounds {figures.spread()})")
    print(f"RESULT transfer_sliced ratio={figures.ratio:.3f} "
          f"sliced_gbps={figures.pdlife_gbps:.3f} whole_gbps={figures.base_gbps:.3f} "
          f"prefill_tp={tp} decode_tp={td} blocks_per_page={per_page} model={shape.name}")


if __name__ == "__main__":
    part_of_transfer("transfer_sliced", "python -m bench.transfer --prefill-tp 2 --decode-tp 1 "
                     "(head slicing from TP 2 to TP 1; any two TP sizes)")
