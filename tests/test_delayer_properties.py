"""Properties of the PrefillDelayer over generated pass sequences, several ranks in lock step.

Ranks are simulated in one process with the two halves of ``negotiate`` (``local_row`` and
``decide_table``): every rank builds its row, the rows form the table a real all-gather would
produce, and every rank decides from it. The real collective is covered by
test_delayer_distributed.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import find, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from scheduler.dist.gather import StaticGather
from scheduler.prefill.delayer import (
    DelayerConfig,
    DelayerMetrics,
    DelayerPass,
    DelayerState,
    NegotiateOutput,
    PrefillDelayer,
    decide,
)
from tests.strategies import (
    DelayerInput,
    DelayerScenario,
    delayer_configs,
    delayer_passes,
    delayer_rows,
)

SEARCH = settings(max_examples=2000, database=None)


def lockstep(
    config: DelayerConfig, passes: Sequence[tuple[Sequence[DelayerInput], int]],
    clocks: Sequence[Sequence[float]],
) -> list[list[NegotiateOutput]]:
    """Run ``len(clocks)`` DP ranks (attention TP 1) through ``passes``; ``clocks[r][k]`` is rank
    r's clock on pass k. Returns ``outputs[k][r]``."""
    dp = len(clocks)
    delayers = [PrefillDelayer(config, StaticGather(), dp_size=dp, attn_tp_size=1,
                               enable_dp_attention=True) for _ in range(dp)]
    outputs = []
    for k, (inputs, max_running) in enumerate(passes):
        table = [[d.local_row(*i, now=clocks[r][k])]
                 for r, (d, i) in enumerate(zip(delayers, inputs, strict=True))]
        outputs.append([d.decide_table(table, max_running, now=clocks[r][k])
                        for r, d in enumerate(delayers)])
    return outputs


def delay_runs(allows: Sequence[bool]) -> list[int]:
    """Lengths of the runs of consecutive delays."""
    runs, current = [], 0
    for allow in allows:
        if allow:
            runs.append(current)
            current = 0
        else:
            current += 1
    return [*runs, current]


def shared_clock(dp: int, steps: Sequence[float]) -> list[list[float]]:
    times = [sum(steps[: k + 1]) for k in range(len(steps))]
    return [times] * dp


def skewed_clocks(rates: Sequence[float], steps: Sequence[float]) -> list[list[float]]:
    return [[rate * sum(steps[: k + 1]) for k in range(len(steps))] for rate in rates]


def decision(out: NegotiateOutput) -> tuple[bool, str, int, float]:
    return out.allow, out.reason, out.wait_forward_passes, out.wait_seconds


@given(delayer_configs(), delayer_passes())
def test_every_rank_decides_identically(
    config: DelayerConfig, scenario: DelayerScenario,
) -> None:
    passes, steps = scenario
    dp = len(passes[0][0])
    for per_rank in lockstep(config, passes, shared_clock(dp, steps)):
        assert all(out == per_rank[0] for out in per_rank)


@given(delayer_configs(), st.lists(delayer_rows(prefillable=False), min_size=1, max_size=4),
       st.none() | st.builds(DelayerState, start_time=st.floats(0, 10),
                             delayed_count=st.integers(0, 50)), st.booleans())
def test_none_prefillable_always_allows(
    config: DelayerConfig, rows: list[list[int]], prev: DelayerState | None, skip: bool,
) -> None:
    rows = [[*r, 0] if config.mode == "bounded" else r for r in rows]
    out, skip_after = decide(rows, prev, 20.0, config, skip_first=skip, dp_size=len(rows),
                             enable_dp_attention=True, max_running_requests=8)
    assert (out.allow, out.reason, out.input_estimation, out.next_state) == (True, "", "none", None)
    assert skip_after == skip


@given(delayer_configs(watermark=False), st.integers(2, 4), st.integers(1, 40),
       st.integers(0, 2**16))
def test_mixed_delays_at_most_max_delay_passes_minus_one(
    config: DelayerConfig, dp: int, num_passes: int, seed: int,
) -> None:
    # Rank (seed % dp) is the only prefillable one: the table is mixed on every pass.
    ready = seed % dp
    inputs = [(r == ready, 0.5, seed % 7, seed % 5, seed % 3) for r in range(dp)]
    outputs = lockstep(config, [(inputs, 8)] * num_passes, shared_clock(dp, [0.01] * num_passes))
    allows = [per_rank[0].allow for per_rank in outputs]
    assert max(delay_runs(allows)) <= config.max_delay_passes - 1
    for k, per_rank in enumerate(outputs):
        if per_rank[0].allow:
            assert per_rank[0].reason == "wait_timeout"
            assert per_rank[0].wait_forward_passes == config.max_delay_passes - 1
            assert k % config.max_delay_passes == config.max_delay_passes - 1


@given(delayer_configs(watermark=False, queue=True),
       st.tuples(st.integers(4, 30), st.integers(1, 8), st.integers(0, 3)),
       st.lists(st.tuples(st.integers(0, 19), st.floats(0.05, 0.6)), min_size=1, max_size=40))
def test_queue_trigger_releases_within_max_delay_ms(
    config: DelayerConfig, row: tuple[int, int, int], passes: list[tuple[int, float]],
) -> None:
    # Every rank prefillable and ample decode slots: only the queue trigger can delay. The queue
    # mostly stays as it is (occasionally it floods, which ends any delay), and clock steps are
    # fractions of max_delay_ms, so that delay runs reach the deadline.
    running, bs, waiting = row
    scenario = [([(True, 0.5, running, bs, waiting if flood else 10**3)], 10**6)
                for flood, _ in passes]
    steps = [fraction * config.max_delay_ms / 1000.0 for _, fraction in passes]
    clock = shared_clock(1, steps)[0]
    first_delay: float | None = None
    for k, (out,) in enumerate(lockstep(config, scenario, [clock])):
        if out.allow:
            first_delay = None
            continue
        first_delay = clock[k] if first_delay is None else first_delay
        # 1 us of slack: bounded mode carries the wait as whole microseconds.
        assert (clock[k] - first_delay) * 1000.0 < config.max_delay_ms + 1e-3


@given(delayer_configs(), delayer_passes(max_dp=1))
def test_state_resets_on_every_release_and_counts_every_delay(
    config: DelayerConfig, scenario: DelayerScenario,
) -> None:
    passes, steps = scenario
    clock = shared_clock(1, steps)[0]
    prev: DelayerState | None = None
    for k, (out,) in enumerate(lockstep(config, passes, [clock])):
        if out.allow:
            assert out.next_state is None
            assert out.wait_forward_passes == (prev.delayed_count if prev else 0)
        else:
            start = prev.start_time if prev else clock[k]
            count = prev.delayed_count + 1 if prev else 1
            assert out.next_state == DelayerState(start_time=start, delayed_count=count)
        prev = out.next_state


@given(delayer_configs(), st.lists(st.tuples(
    delayer_rows(), st.lists(delayer_rows(), min_size=2, max_size=2), st.booleans(),
    st.booleans()), min_size=1, max_size=20))
def test_metrics_are_recorded_once_per_pass(
    config: DelayerConfig, passes: list[tuple[list[int], list[list[int]], bool, bool]],
) -> None:
    registry = CollectorRegistry()
    extra = [0] if config.mode == "bounded" else []
    gather = StaticGather([[[0] * (5 + len(extra))]] * 3, position=(0, 0))
    delayer = PrefillDelayer(config, gather, dp_size=3, attn_tp_size=1, enable_dp_attention=True,
                             clock=lambda: 5.0, metrics=DelayerMetrics(registry, 30))
    observed = 0
    for own, others, asks, actual in passes:
        gather.set_table([[[0] * (5 + len(extra))]] + [[[*r, *extra]] for r in others])
        single = DelayerPass(delayer, token_usage=0.5)
        if asks:
            single.allow(bool(own[0]), own[2], own[3], 8, own[4])
        out = single.finalize(actual_prefill=actual)
        observed += out.allow and actual
    assert len(gather.sent) == len(passes)
    assert sum(delayer.outcomes.values()) == len(passes)
    total = sum(s.value for m in registry.collect() for s in m.samples
                if s.name == "pdlife_prefill_delayer_outcomes_total")
    assert total == len(passes)
    for name in ("wait_forward_passes", "wait_seconds"):
        count = registry.get_sample_value(f"pdlife_prefill_delayer_{name}_count")
        assert count == observed


def slot_blocked_runs(mode: str, max_delay_passes: int, running: int, prefill_bs: int,
                      max_running: int) -> list[int]:
    """Delay runs of one rank that sees the same all-prefillable table for many passes."""
    config = DelayerConfig(max_delay_passes=max_delay_passes, mode=mode)  # type: ignore[arg-type]
    num = 3 * max_delay_passes + 2
    inputs = [(True, 0.5, running, prefill_bs, 0)]
    outputs = lockstep(config, [(inputs, max_running)] * num, shared_clock(1, [0.01] * num))
    return delay_runs([out.allow for (out,) in outputs])


def test_search_finds_the_unbounded_slot_delay_of_sglang_mode() -> None:
    found = find(
        st.tuples(st.integers(1, 6), st.integers(0, 20), st.integers(0, 8), st.integers(0, 40)),
        lambda args: max(slot_blocked_runs("sglang", *args)) > args[0],
        settings=SEARCH,
    )
    assert max(slot_blocked_runs("sglang", *found)) > found[0]
    # The same inputs are bounded in bounded mode.
    assert max(slot_blocked_runs("bounded", *found)) <= found[0] - 1


def skew_decisions(mode: str, rates: tuple[float, float], max_delay_ms: int) -> list[set[bool]]:
    """Per pass, the set of allow answers of two ranks whose clocks run at ``rates``."""
    config = DelayerConfig(queue_min_ratio=0.5, max_delay_ms=max_delay_ms,
                           mode=mode)  # type: ignore[arg-type]
    inputs = [(True, 0.5, 10, 4, 2)] * 2  # queue_min 4 > 2 waiting
    outputs = lockstep(config, [(inputs, 10**6)] * 12, skewed_clocks(rates, [0.01] * 12))
    return [{out.allow for out in per_rank} for per_rank in outputs]


def test_search_finds_ranks_splitting_on_skewed_clocks_in_sglang_mode() -> None:
    found = find(
        st.tuples(st.floats(0.5, 3.0), st.floats(0.5, 3.0), st.integers(5, 60)),
        lambda a: any(len(s) > 1 for s in skew_decisions("sglang", (a[0], a[1]), a[2])),
        settings=SEARCH,
    )
    assert any(len(s) > 1 for s in skew_decisions("sglang", (found[0], found[1]), found[2]))
    assert all(len(s) == 1 for s in skew_decisions("bounded", (found[0], found[1]), found[2]))


@given(delayer_configs(mode="bounded"), delayer_passes(),
       st.lists(st.floats(0.25, 4.0), min_size=4, max_size=4))
def test_bounded_mode_bounds_every_delay_and_agrees_under_skew(
    config: DelayerConfig, scenario: DelayerScenario,
    rates: list[float],
) -> None:
    passes, steps = scenario
    dp = len(passes[0][0])
    outputs = lockstep(config, passes, skewed_clocks(rates[:dp], steps))
    for per_rank in outputs:
        assert len({decision(out) for out in per_rank}) == 1
    assert max(delay_runs([per_rank[0].allow for per_rank in outputs])) <= (
        config.max_delay_passes - 1)
