"""The PrefillDelayer's effect across data-parallel ranks.

N ranks run as processes in one gloo group, each with its own prefill scheduler, the tiny
reference model and the fake transfer backend (instant handshake and transfer). Requests arrive
at a skewed rate per rank (rank 0 busiest). Every pass the ranks record whether they ran a
prefill batch and gather the flags (the same collective in both runs); the aligned share is the
fraction of passes with any prefill in which every rank prefilled together. The same arrival
sequence runs without and with the delayer (SGLang mode, DP attention on), in one launch.

Last line: ``RESULT delayer aligned_share_with=.. aligned_share_without=.. mean_batch_with=..
mean_batch_without=..``
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kv.fake import FakeKVManager
from kv.metadata import MetadataBuffers, SlotAllocator
from scheduler.dist import rendezvous
from scheduler.dist.gather import TorchDistributedGather
from scheduler.messages import FAKE_BOOTSTRAP_HOST, NewRequest
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import DelayerConfig, PrefillDelayer
from scheduler.prefill.scheduler import PrefillScheduler


def arrival_rate(rank: int, world: int) -> float:
    # Rank 0 gets a request on half the passes, the last rank on a tenth of them.
    return 0.5 - 0.4 * rank / max(1, world - 1)


def run_rank(rank: int, world: int, passes: int, with_delayer: bool, seed: int) -> dict[str, Any]:
    model = LlamaModel(ModelConfig.tiny(seed=1))
    pool = model.make_pool(num_pages=1024, page_size=16)
    delayer = None
    if with_delayer:
        gather = TorchDistributedGather(dist.group.WORLD, dp_size=world, attn_tp_size=1)
        delayer = PrefillDelayer(DelayerConfig(max_delay_passes=30), gather, dp_size=world,
                                 attn_tp_size=1, enable_dp_attention=True)
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=16, chunked_prefill_size=2048),
        runner=PagedModelRunner(model, pool),
        kv=FakeKVManager(),
        metadata=MetadataBuffers(256),
        slots=SlotAllocator(256),
        delayer=delayer,
    )
    rnd = random.Random(seed * 1000 + rank)
    rate = arrival_rate(rank, world)
    batches: list[int] = []
    aligned = any_ran = 0
    for p in range(passes):
        if rnd.random() < rate:
            sched.submit(NewRequest(f"r{rank}-{p}", tuple(rnd.randrange(256) for _ in range(64)),
                                    bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=p + 1))
        sched.step()
        ran = int(sched.last_batch_size > 0)
        if ran:
            batches.append(sched.last_batch_size)
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(flags, torch.tensor([ran], dtype=torch.int64))
        any_ran += max(int(f) for f in flags)
        aligned += min(int(f) for f in flags)
    sched.close()
    return {"batches": batches, "aligned": aligned, "any": any_ran,
            "outcomes": dict(delayer.outcomes) if delayer else {}}


def worker(rank: int, world: int, passes: int, seed: int, out: str) -> None:
    rendezvous.join(str(Path(out, "store")), rank, world, timedelta(seconds=120))
    try:
        result = {
            "without": run_rank(rank, world, passes, False, seed),
            "with": run_rank(rank, world, passes, True, seed),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4,
                    help="data-parallel ranks, one process each (default: %(default)s)")
    ap.add_argument("--passes", type=int, default=400,
                    help="scheduler passes per rank, with and without the delayer "
                         "(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the arrivals each rank draws (default: %(default)s)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(args.ranks, args.passes, args.seed, out),
                           nprocs=args.ranks, start_method="spawn", join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    figures = {}
    for mode in ("without", "with"):
        sizes = [b for r in ranks for b in r[mode]["batches"]]
        prefill_passes = [len(r[mode]["batches"]) for r in ranks]
        aligned, any_ran = ranks[0][mode]["aligned"], ranks[0][mode]["any"]
        figures[mode] = (aligned / max(1, any_ran), sum(sizes) / max(1, len(sizes)))
        print(f"{mode:7s} delayer: prefill passes per rank {prefill_passes}, mean batch "
              f"{figures[mode][1]:.2f}, all ranks prefilled together in {aligned} of the "
              f"{any_ran} passes in which any rank prefilled")
    print(f"delayer outcomes (rank 0): {ranks[0]['with']['outcomes']}")
    print(f"RESULT delayer aligned_share_with={figures['with'][0]:.3f} "
          f"aligned_share_without={figures['without'][0]:.3f} "
          f"mean_batch_with={figures['with'][1]:.2f} "
          f"mean_batch_without={figures['without'][1]:.2f}")


if __name__ == "__main__":
    main()
