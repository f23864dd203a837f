"""The Mooncake sender's cut size (``MooncakeConfig.max_block_bytes``) against the raw engine.

One live sender writes the churned plan of :mod:`bench.transfer` with each cut in turn, round
by round (the order reversed every other round, so a drift in the machine's load favours no
cut), against the raw engine writing the same bytes as one region (page-major) or as one region
per layer (layer-major). ``python -m bench.transfer --cuts 1,16,64`` (MiB) prints, per layout
and cut, the median and mean of the per-round ratios: the figures the default cut was chosen
from (docs/benchmarks.md). No RESULT line: it compares settings, it checks no target.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

from bench import part_of_transfer
from bench.transfer_plans import churned_requests
from kv.mooncake import MooncakeKVManager
from kv.pool_layout import KVLayout

if TYPE_CHECKING:
    from bench.transfer import Figures, Shape


def bench_cuts(args: argparse.Namespace, shape: Shape, cuts_mib: list[int]) -> None:
    from bench.transfer import Figures, bench_mooncake, timed

    plans = {"churned": churned_requests(args.pages, args.requests, args.min_pages,
                                         args.max_pages, args.churn, args.seed)}

    def rounds(manager: MooncakeKVManager, total: int, ours: Callable[[], float],
               bases: dict[str, Callable[[], float]]) -> dict[str, Figures]:
        ratios: dict[int, list[float]] = {mib: [] for mib in cuts_mib}
        ours_gbps: dict[int, list[float]] = {mib: [] for mib in cuts_mib}
        raw: list[float] = []
        for it in range(args.iters + 1):  # the first round warms up
            gbps = {}
            for mib in cuts_mib if it % 2 else cuts_mib[::-1]:
                # The config is frozen; the pipeline reads its cut for every write.
                manager._writes._max_block_bytes = mib << 20
                gbps[mib] = timed(total, ours())
            base = timed(total, bases["regions"]())
            if it:
                raw.append(base)
                for mib in cuts_mib:
                    ours_gbps[mib].append(gbps[mib])
                    ratios[mib].append(gbps[mib] / base)
        return {f"{mib} MiB": Figures(statistics.median(ours_gbps[mib]), statistics.median(raw),
                                      statistics.median(r), r)
                for mib, r in ratios.items()}

    print(f"geometry {shape.name}, {args.iters} rounds, cuts of {cuts_mib} MiB")
    for layout in KVLayout:
        figures = bench_mooncake(args, plans, shape, layout, rounds)["churned"]
        for cut, f in figures.items():
            print(f"{layout.value:11s} cut {cut:>7s}: ratio median {f.ratio:.3f} "
                  f"mean {statistics.mean(f.rounds):.3f} (rounds {f.spread()}), "
                  f"{f.pdlife_gbps:.2f} GB/s, raw {f.base_gbps:.2f} GB/s")


if __name__ == "__main__":
    part_of_transfer("transfer_cuts",
                     "python -m bench.transfer --cuts 1,16,64 (the cut sizes compared, in MiB)")
