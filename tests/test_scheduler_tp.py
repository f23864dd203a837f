"""Two TP ranks over a real gloo group take identical transitions (invariant 6).

Each rank runs its own scheduler with the fake backend; the fault plans differ per rank, so some
failures are seen by one rank only. The ranks agree on the rooms to poll and MIN-combine the
results, so both fail those requests on the same pass, with the same reason.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kv.fake import FakeKVManager, FaultPlan
from kv.metadata import MetadataBuffers, SlotAllocator
from scheduler.dist.ranks import TorchRanks
from scheduler.messages import NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from tests.distributed import free_port, run_ranks

WORLD = 2
REQUESTS = 24
LAUNCH_TIMEOUT_S = 180.0


def fault_plan(rank: int) -> FaultPlan:
    return FaultPlan(seed=100 + rank, bootstrap_failure=0.15, transfer_failure=0.15)


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        model = LlamaModel(ModelConfig.tiny(seed=5))
        pool = model.make_pool(num_pages=256, page_size=4)
        responses: list[Response] = []
        sched = PrefillScheduler(
            config=SchedulerConfig(page_size=4, chunked_prefill_size=32, check_invariants=True),
            runner=PagedModelRunner(model, pool),
            kv=FakeKVManager(fault_plan(rank)),
            metadata=MetadataBuffers(6),
            slots=SlotAllocator(6),
            ranks=TorchRanks(),
            on_response=responses.append,
        )
        for i in range(REQUESTS):
            sched.submit(NewRequest(f"r{i}", tuple(range(1, 2 + 7 * i % 90)),
                                    bootstrap_host="decode", bootstrap_room=i + 1))
        passes: list[list[Any]] = []
        while True:
            sched.step()
            sched.check_invariants()
            passes.append(sorted([r.rid, r.state.name] for r in sched.lifecycle.live()))
            idle = torch.tensor([int(sched.idle())], dtype=torch.int32)
            dist.all_reduce(idle, op=dist.ReduceOp.MIN)
            if idle.item():
                break
        result = {
            "responses": [[r.rid, r.state.name, r.reason and r.reason.value] for r in responses],
            "passes": passes,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_tp_ranks_take_identical_transitions(tmp_path: Path) -> None:
    run_ranks(_worker, (free_port(), str(tmp_path)), WORLD, LAUNCH_TIMEOUT_S)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["responses"] == ranks[1]["responses"]
    assert ranks[0]["passes"] == ranks[1]["passes"]
    assert len(ranks[0]["responses"]) == REQUESTS

    # Some failures were injected on one rank only, and both ranks failed those requests.
    plans = [fault_plan(r) for r in range(WORLD)]
    one_sided = [
        i for i in range(REQUESTS)
        if len({plan.decide(i + 1) != plan.decide(0) and plan.decide(i + 1) for plan in plans}) > 1
    ]
    outcome = {rid: (state, reason) for rid, state, reason in ranks[0]["responses"]}
    failed_one_sided = [i for i in one_sided if outcome[f"r{i}"][0] == "FAILED"]
    assert failed_one_sided, "the fault plans injected no one-sided failure"
    for i in range(REQUESTS):
        faults = [plan.decide(i + 1) for plan in plans]
        if any(f.bootstrap_failure for f in faults):
            assert outcome[f"r{i}"] == ("FAILED", "bootstrap_failed")
        elif any(f.transfer_failure for f in faults):
            assert outcome[f"r{i}"] == ("FAILED", "transfer_failed")
        else:
            assert outcome[f"r{i}"] == ("DONE", None)
