"""Where the transfer benchmark's pages come from: page lists of requests in a pool after churn,
or in a pool shredded into short free runs (:mod:`bench.transfer`)."""

from __future__ import annotations

import random

from bench import part_of_transfer
from kv.pages import coalesce
from kv.pool import PageAllocator

Plan = list[list[int]]


def churned_requests(num_pages: int, requests: int, min_pages: int, max_pages: int,
                     churn: int, seed: int) -> Plan:
    """Page lists for ``requests`` requests allocated by a :class:`PageAllocator` after
    ``churn`` arrivals of requests of ``min_pages``-``max_pages`` pages at up to 75% occupancy,
    each departure the oldest of a few."""
    if max_pages > num_pages:
        raise SystemExit(f"a request of {max_pages} pages does not fit a pool of {num_pages}")
    rng = random.Random(seed)
    alloc = PageAllocator(num_pages)
    live: Plan = []

    def depart() -> None:
        alloc.free(live.pop(min(int(rng.expovariate(1 / 3)), len(live) - 1)))

    for _ in range(churn):
        n = rng.randint(min_pages, max_pages)
        while (pages := alloc.alloc(n)) is None:
            depart()
        live.append(pages)
        while alloc.in_use() > 0.75 * num_pages:
            depart()
    plan: Plan = []
    for _ in range(requests):
        n = rng.randint(min_pages, max_pages)
        while (pages := alloc.alloc(n)) is None:
            alloc.free(live.pop(0))
        plan.append(pages)
    return plan


def shredded_requests(num_pages: int, requests: int, pages_each: int, run_pages: int,
                      seed: int) -> Plan:
    """Page lists for ``requests`` requests, drawn from free runs of ``run_pages`` pages."""
    runs = [list(range(s, min(s + run_pages, num_pages))) for s in range(0, num_pages, run_pages)]
    random.Random(seed).shuffle(runs)
    free = [p for run in runs for p in run]
    need = requests * pages_each
    if need > len(free):
        raise SystemExit(f"pool of {num_pages} pages cannot hold {need}")
    return [free[i * pages_each : (i + 1) * pages_each] for i in range(requests)]


def describe(name: str, plan: Plan, pool_pages: int, page_mib: float, num_layers: int) -> str:
    """One line on a plan: its pages, bytes, and how many blocks its runs make per layout."""
    pages = sum(len(p) for p in plan)
    runs = sum(len(coalesce(p, list(range(len(p))))) for p in plan)
    return (f"{name}: {len(plan)} requests, {pages} of {pool_pages} pages "
            f"({pages * page_mib:.0f} MiB per round), {pages / runs:.1f} pages per run, "
            f"at most {runs} blocks per round page-major, {runs * 2 * num_layers} layer-major")


if __name__ == "__main__":
    part_of_transfer("transfer_plans",
                     "python -m bench.transfer (its plans: --pages, --requests, --min-pages, "
                     "--max-pages, --churn, --shredded-requests, --shredded-pages, --run-pages)")
