"""PrefillDelayer over a real 4-process gloo group: SGLang's negotiation scenarios, the clock-skew
hazard that bounded mode removes, and ``min_reduce``.

One process-group launch runs everything (start-up dominates); each rank writes its results to a
JSON file and the tests below assert on them.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lifecycle.testing import FakeClock
from scheduler.dist.gather import TorchDistributedGather, min_reduce
from scheduler.prefill.delayer import DelayerConfig, PrefillDelayer
from tests.distributed import free_port, run_ranks

WORLD = 4
LAUNCH_TIMEOUT_S = 180.0
T, F = True, False
HIGH = (0.9, 0.9, 0.9, 0.9)
LOW_ON_0 = (0.5, 0.9, 0.9, 0.9)

# name: (max_delay_passes, watermark, [(prefillable per rank, token usage per rank)], expected)
SCENARIOS: dict[str, tuple[int, float | None, list[tuple[tuple[bool, ...], tuple[float, ...]]],
                           tuple[bool, str]]] = {
    "all_prefillable": (100, 0.8, [((T, T, T, T), HIGH)], (True, "no_wait")),
    "all_prefillable_with_previous_wait": (
        100, 0.8, [((T, F, T, F), HIGH), ((T, T, T, T), HIGH)], (True, "wait_success")),
    "none_prefillable": (100, 0.8, [((F, F, F, F), HIGH)], (True, "")),
    "mixed_delay": (100, 0.8, [((T, F, T, F), HIGH)], (False, "delay")),
    "mixed_watermark_force_allow": (
        100, 0.8, [((T, F, T, F), LOW_ON_0)], (True, "token_watermark")),
    "mixed_watermark_disabled": (100, None, [((T, F, T, F), LOW_ON_0)], (False, "delay")),
    "mixed_watermark_not_prefillable": (100, 0.8, [((F, F, T, F), LOW_ON_0)], (False, "delay")),
    "mixed_timeout": (3, 0.8, [((T, F, T, F), HIGH)] * 3, (True, "wait_timeout")),
}
SKEW_PASSES = 8


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        gather = TorchDistributedGather(dist.group.WORLD, dp_size=WORLD, attn_tp_size=1)
        results: dict[str, Any] = {}
        for mode in ("sglang", "bounded"):
            for name, (passes, watermark, calls, _) in SCENARIOS.items():
                config = DelayerConfig(max_delay_passes=passes,
                                       token_usage_low_watermark=watermark, mode=mode)
                delayer = PrefillDelayer(config, gather, dp_size=WORLD, attn_tp_size=1,
                                         enable_dp_attention=True)
                for prefillable, usage in calls:
                    out = delayer.negotiate(prefillable[rank], usage[rank])
                results[f"{mode}/{name}"] = [out.allow, out.reason]
            # The queue trigger (min(int(10 * 0.5), 4) = 4 > 2 waiting) with a 100 ms deadline,
            # every rank's clock running at its own rate.
            clock = FakeClock()
            # Rank r's clock runs at (1 + r) times rank 0's: 30 ms of rank-0 time per pass.
            rate = 0.03 * (1 + rank)
            config = DelayerConfig(queue_min_ratio=0.5, max_delay_ms=100, mode=mode)
            delayer = PrefillDelayer(config, gather, dp_size=WORLD, attn_tp_size=1,
                                     enable_dp_attention=True, clock=clock)
            allows = []
            for _ in range(SKEW_PASSES):
                out = delayer.negotiate(True, 0.9, running_batch=10, max_prefill_bs=4,
                                        max_running_requests=100, waiting_queue_len=2)
                allows.append(out.allow)
                clock.now += rate
            results[f"{mode}/skew"] = allows
        pair = dist.new_group([0, 1], backend="gloo")  # every rank must take part in new_group
        if rank < 2:
            results["min_pair"] = min_reduce([3 + rank, 7 - rank, 4, 1 + rank], pair)
        results["min_world"] = min_reduce([WORLD - rank, rank + 1], dist.group.WORLD)
        results["min_empty"] = min_reduce([], dist.group.WORLD)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("delayer_ranks")
    run_ranks(_worker, (free_port(), str(out_dir)), WORLD, LAUNCH_TIMEOUT_S)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sglang", "bounded"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sglang_scenarios(rank_results: list[dict[str, Any]], mode: str, name: str) -> None:
    expected = list(SCENARIOS[name][3])
    assert [r[f"{mode}/{name}"] for r in rank_results] == [expected] * WORLD


@pytest.mark.multiprocess
def test_skewed_clocks_split_sglang_but_not_bounded(rank_results: list[dict[str, Any]]) -> None:
    bounded = [r["bounded/skew"] for r in rank_results]
    # Pass 0 is the skipped first trigger; then delay until rank 0's clock shows 120 ms.
    assert bounded == [[True, False, False, False, False, True, False, False]] * WORLD
    sglang = [r["sglang/skew"] for r in rank_results]
    assert sglang[0] == bounded[0]
    assert sglang[3] == [True, False, True, False, True, False, True, False]


@pytest.mark.multiprocess
def test_min_reduce(rank_results: list[dict[str, Any]]) -> None:
    assert [r["min_pair"] for r in rank_results[:2]] == [[3, 6, 4, 1]] * 2
    assert all("min_pair" not in r for r in rank_results[2:])
    assert [r["min_world"] for r in rank_results] == [[1, 1]] * WORLD
    assert [r["min_empty"] for r in rank_results] == [[]] * WORLD
