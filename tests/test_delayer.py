"""PrefillDelayer: the pure decision, the stateful delayer, the single-pass executor, metrics."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from lifecycle.testing import FakeClock
from scheduler.dist.gather import GatherShapeError, StaticGather
from scheduler.prefill.delayer import (
    DelayerConfig,
    DelayerConfigError,
    DelayerMetrics,
    DelayerPass,
    DelayerPassError,
    DelayerState,
    NegotiateOutput,
    PrefillDelayer,
    decide,
)

NOW = 1000.0


def run(
    rows: list[list[int]], prev: DelayerState | None = None, *, skip_first: bool = False,
    max_running_requests: int = 0, dp_size: int = 1, enable_dp_attention: bool = True,
    now: float = NOW, **config: object,
) -> tuple[NegotiateOutput, bool]:
    return decide(
        rows, prev, now, DelayerConfig(**config),  # type: ignore[arg-type]
        skip_first=skip_first, dp_size=dp_size, enable_dp_attention=enable_dp_attention,
        max_running_requests=max_running_requests,
    )


# --- records -------------------------------------------------------------------------------


def test_state_defaults_and_bump_returns_new_state() -> None:
    state = DelayerState(start_time=5.0)
    assert state.delayed_count == 0
    bumped = state.bump()
    assert (bumped.delayed_count, bumped.start_time) == (1, 5.0)
    assert state.delayed_count == 0 and bumped is not state
    for _ in range(4):
        bumped = bumped.bump()
    assert bumped.delayed_count == 5


def test_output_wait_fields_default_to_zero() -> None:
    out = NegotiateOutput(None, "none", True, "", 0, 0)
    assert (out.wait_forward_passes, out.wait_seconds) == (0, 0.0)


# --- decide: SGLang's cases ----------------------------------------------------------------


def test_none_prefillable_allows_with_empty_reason() -> None:
    out, skip = run([[0, 0, 0, 0, 0]], skip_first=True)
    assert (out.allow, out.reason, out.input_estimation) == (True, "", "none")
    assert out.next_state is None and skip is True


def test_all_prefillable_with_watermark_forces_allow() -> None:
    out, _ = run([[1, 1, 0, 0, 0]])
    assert (out.allow, out.reason, out.input_estimation) == (True, "token_watermark", "all")
    assert out.num_token_watermark_force_allow == 1


def test_all_prefillable_without_condition_is_no_wait() -> None:
    out, _ = run([[1, 0, 1, 1, 0]], max_running_requests=100)
    assert (out.allow, out.reason, out.next_state) == (True, "no_wait", None)
    assert (out.wait_forward_passes, out.wait_seconds) == (0, 0.0)


def test_release_after_wait_carries_the_wait() -> None:
    prev = DelayerState(start_time=NOW - 0.5, delayed_count=2)
    out, _ = run([[1, 0, 1, 1, 0]], prev, max_running_requests=100)
    assert (out.allow, out.reason, out.next_state) == (True, "wait_success", None)
    assert out.wait_forward_passes == 2
    assert out.wait_seconds == pytest.approx(0.5)


def test_skip_first_lets_the_first_slot_condition_through_once() -> None:
    rows = [[1, 0, 9, 5, 0]]  # 10 - 9 < 5: too few free slots for a prefill batch
    out, skip = run(rows, skip_first=True, max_running_requests=10)
    assert (out.allow, out.reason, skip) == (True, "no_wait", False)
    out, skip = run(rows, skip_first=skip, max_running_requests=10)
    assert (out.allow, out.reason, skip) == (False, "delay", False)
    assert out.next_state == DelayerState(start_time=NOW, delayed_count=1)
    assert (out.wait_forward_passes, out.wait_seconds) == (0, 0.0)


def test_mixed_with_watermark_forces_allow() -> None:
    out, _ = run([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dp_size=2)
    assert (out.allow, out.reason, out.input_estimation) == (True, "token_watermark", "mixed")
    assert (out.num_prefillable, out.num_token_watermark_force_allow) == (1, 1)


def test_mixed_delays_then_times_out() -> None:
    rows = [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    out, _ = run(rows, None, max_delay_passes=3, dp_size=2)
    assert (out.allow, out.reason) == (False, "delay")
    assert out.next_state is not None and out.next_state.delayed_count == 1
    prev = DelayerState(start_time=NOW - 0.25, delayed_count=2)
    out, _ = run(rows, prev, max_delay_passes=3, dp_size=2)
    assert (out.allow, out.reason, out.next_state) == (True, "wait_timeout", None)
    assert out.wait_forward_passes == 2
    assert out.wait_seconds == pytest.approx(0.25)


def test_queue_trigger_delays_until_max_delay_ms() -> None:
    rows = [[1, 0, 10, 4, 2]]  # queue_min = min(int(10 * 0.5), 4) = 4 and 2 < 4
    common = dict(queue_min_ratio=0.5, max_running_requests=100)
    out, _ = run(rows, **common)  # type: ignore[arg-type]
    assert (out.allow, out.reason) == (False, "delay")
    fresh = DelayerState(start_time=NOW, delayed_count=1)
    out, _ = run(rows, fresh, max_delay_ms=5000, **common)  # type: ignore[arg-type]
    assert (out.allow, out.reason) == (False, "delay")
    old = DelayerState(start_time=NOW - 0.2, delayed_count=7)
    out, _ = run(rows, old, max_delay_ms=100, **common)  # type: ignore[arg-type]
    assert (out.allow, out.reason, out.wait_forward_passes) == (True, "wait_success", 7)


def test_queue_trigger_deadline_is_inclusive() -> None:
    common = dict(queue_min_ratio=0.5, max_delay_ms=100, max_running_requests=100)
    just_before = DelayerState(start_time=NOW - 0.099, delayed_count=3)
    out, _ = run([[1, 0, 10, 4, 2]], just_before, **common)  # type: ignore[arg-type]
    assert out.reason == "delay"
    at_deadline = DelayerState(start_time=NOW - 0.1, delayed_count=3)
    out, _ = run([[1, 0, 10, 4, 2]], at_deadline, **common)  # type: ignore[arg-type]
    assert out.reason == "wait_success"


def test_queue_trigger_is_off_without_a_ratio_or_running_batch() -> None:
    out, _ = run([[1, 0, 10, 4, 2]], max_running_requests=100)
    assert out.reason == "no_wait"
    out, _ = run([[1, 0, 0, 4, 2]], queue_min_ratio=0.5, max_running_requests=100)
    assert out.reason == "no_wait"


def test_max_running_requests_is_split_across_dp_without_dp_attention() -> None:
    row = [1, 0, 1, 3, 0]
    out, _ = run([row] * 4, max_running_requests=10, dp_size=4, enable_dp_attention=True)
    assert out.reason == "no_wait"  # 10 - 1 >= 3
    # Without DP attention the table has one replica entry: one row, whatever dp_size.
    out, _ = run([row], max_running_requests=10, dp_size=4, enable_dp_attention=False)
    assert out.reason == "delay"  # ceil(10 / 4) - 1 = 2 < 3


def test_sglang_mode_slot_delay_has_no_pass_bound() -> None:
    prev = DelayerState(start_time=NOW, delayed_count=500)
    out, _ = run([[1, 0, 9, 5, 0]], prev, max_delay_passes=3, max_running_requests=10)
    assert (out.allow, out.reason) == (False, "delay")


def test_bounded_mode_bounds_the_slot_delay() -> None:
    rows = [[1, 0, 9, 5, 0, 0]]
    prev = DelayerState(start_time=NOW, delayed_count=1)
    out, _ = run(rows, prev, max_delay_passes=3, max_running_requests=10, mode="bounded")
    assert (out.allow, out.reason) == (False, "delay")
    out, _ = run(rows, prev.bump(), max_delay_passes=3, max_running_requests=10, mode="bounded")
    assert (out.allow, out.reason, out.wait_forward_passes) == (True, "wait_timeout", 2)


def test_bounded_mode_reads_the_min_gathered_wait() -> None:
    prev = DelayerState(start_time=NOW - 9.0, delayed_count=3)  # the local clock is ignored
    common = dict(queue_min_ratio=0.5, max_delay_ms=100, max_running_requests=100, dp_size=2,
                  mode="bounded")
    out, _ = run([[1, 0, 10, 4, 2, 300_000], [1, 0, 10, 4, 2, 50_000]], prev,
                 **common)  # type: ignore[arg-type]
    assert (out.allow, out.reason) == (False, "delay")
    out, _ = run([[1, 0, 10, 4, 2, 300_000], [1, 0, 10, 4, 2, 150_000]], prev,
                 **common)  # type: ignore[arg-type]
    assert (out.allow, out.reason) == (True, "wait_success")
    assert out.wait_seconds == pytest.approx(0.15)


@pytest.mark.parametrize("rows", [[], [[1, 0, 0, 0]], [[1, 0, 0, 0, 0, 0]]])
def test_decide_rejects_rows_of_the_wrong_width(rows: list[list[int]]) -> None:
    with pytest.raises(GatherShapeError, match="width 5"):
        run(rows)


def test_decide_given_the_gathered_table_says_it_wants_a_row_per_replica() -> None:
    """A [dp][tp] table of rows where each replica's TP-rank-0 row goes said "got [1, 1]"."""
    table = [[[1, 0, 0, 0, 0]], [[1, 0, 0, 0, 0]]]
    with pytest.raises(GatherShapeError, match=r"one per DP replica \(dp_size=2; its TP rank "
                                               r"0's: table\[dp\]\[0\], not the gathered "
                                               r"table\), got rows of lengths \[1, 1\]"):
        run(table, dp_size=2)  # type: ignore[arg-type]


def test_decide_refuses_fewer_rows_than_replicas_as_decide_table_does() -> None:
    """One row with dp_size=2 and DP attention was decided as if there were one replica."""
    config = DelayerConfig()
    with pytest.raises(GatherShapeError, match=r"decide needs 2 rows of width 5 .* one per DP "
                                               r"replica \(dp_size=2;.*got rows of lengths \[5\]"):
        run([[1, 0, 0, 0, 0]], dp_size=2, enable_dp_attention=True)
    delayer = PrefillDelayer(config, StaticGather(), dp_size=2, attn_tp_size=1,
                             enable_dp_attention=True, clock=FakeClock())
    with pytest.raises(GatherShapeError, match=r"expected a \[2\]\[1\] table"):
        delayer.decide_table([[[1, 0, 0, 0, 0]]], 10, now=NOW)
    with pytest.raises(GatherShapeError, match=r"decide needs 3 rows"):
        run([[1, 0, 0, 0, 0]] * 2, dp_size=3)
    with pytest.raises(GatherShapeError, match=r"decide needs dp_size >= 1, got 0"):
        run([[1, 0, 0, 0, 0]], dp_size=0)


def test_decide_without_dp_attention_takes_the_single_replica_row() -> None:
    """SGLang gathers a [1][attn_tp] table without DP attention, whatever dp_size."""
    rows = [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    with pytest.raises(GatherShapeError, match=r"decide needs 1 row of width 5 .*without DP "
                                               r"attention the table has one entry whatever "
                                               r"dp_size \(2\), got rows of lengths \[5, 5\]"):
        run(rows, dp_size=2, enable_dp_attention=False)
    delayer = PrefillDelayer(DelayerConfig(), StaticGather(), dp_size=2, attn_tp_size=1,
                             enable_dp_attention=False, clock=FakeClock())
    assert delayer.negotiate(True, 0.5, max_running_requests=10).reason == "no_wait"
    with pytest.raises(GatherShapeError, match=r"expected a \[1\]\[1\] table"):
        delayer.decide_table([[[1, 0, 0, 0, 0]], [[1, 0, 0, 0, 0]]], 10, now=NOW)


# --- config --------------------------------------------------------------------------------


def test_config_defaults() -> None:
    config = DelayerConfig()
    assert (config.max_delay_passes, config.max_delay_ms, config.mode) == (30, 5000.0, "sglang")
    assert config.token_usage_low_watermark is None and config.queue_min_ratio is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_delay_passes", 0, "max_delay_passes must be an integer >= 1, got 0"),
        ("token_usage_low_watermark", 1.5, r"low_watermark must be None or in \[0, 1\]"),
        ("queue_min_ratio", 0.0, r"queue_min_ratio must be None or in \(0, 1\], got 0.0"),
        ("queue_min_ratio", 1.01, r"queue_min_ratio must be None or in \(0, 1\]"),
        ("max_delay_ms", 0, "max_delay_ms must be a finite number > 0, got 0.0"),
        ("max_delay_ms", float("nan"), "max_delay_ms must be a finite number > 0"),
        ("mode", "fast", "mode must be one of \\['bounded', 'sglang'\\], got 'fast'"),
    ],
)
def test_config_rejects_out_of_range_fields(field: str, value: object, message: str) -> None:
    with pytest.raises(DelayerConfigError, match=message):
        DelayerConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_delay_passes", True, "max_delay_passes must be an integer, got True"),
        ("max_delay_passes", "30", "max_delay_passes must be an integer, got '30'"),
        ("token_usage_low_watermark", "0.5", "must be a number or None, got '0.5'"),
        ("mode", 1, "mode must be a string, got 1"),
        ("debug_log", "no", "debug_log must be a bool, got 'no'"),
    ],
)
def test_config_refuses_wrong_types(field: str, value: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        DelayerConfig(**{field: value})  # type: ignore[arg-type]


# --- the stateful delayer ------------------------------------------------------------------


def test_delayer_refuses_a_config_that_is_not_a_delayer_config() -> None:
    """A dict was taken, and the first negotiate() failed with an AttributeError."""
    with pytest.raises(TypeError, match=r"^config must be a DelayerConfig, got dict "
                                        r"\{'max_delay_passes': 3\}"):
        PrefillDelayer({"max_delay_passes": 3}, StaticGather(),  # type: ignore[arg-type]
                       dp_size=1, attn_tp_size=1, enable_dp_attention=True)


def make_delayer(
    gather: StaticGather | None = None, clock: FakeClock | None = None,
    metrics: DelayerMetrics | None = None, dp_size: int = 1, **config: object,
) -> PrefillDelayer:
    return PrefillDelayer(
        DelayerConfig(**config),  # type: ignore[arg-type]
        gather if gather is not None else StaticGather(), dp_size=dp_size, attn_tp_size=1,
        enable_dp_attention=True, clock=clock or FakeClock(), metrics=metrics,
    )


def test_negotiate_sends_its_row_and_decides_from_tp0_rows() -> None:
    gather = StaticGather(
        [[[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]], position=(1, 0)
    )
    delayer = PrefillDelayer(DelayerConfig(token_usage_low_watermark=0.8), gather, dp_size=2,
                             attn_tp_size=2, enable_dp_attention=True, clock=FakeClock())
    out = delayer.negotiate(True, 0.5, running_batch=3, max_prefill_bs=4, waiting_queue_len=5)
    assert gather.sent == [(1, 1, 3, 4, 5)]
    # TP rank 1 rows claim a watermark, but only TP rank 0 rows count: DP0 is not prefillable.
    assert (out.input_estimation, out.allow, out.reason) == ("mixed", True, "token_watermark")
    assert out.num_token_watermark_force_allow == 1


def test_watermark_flag_needs_local_prefillable() -> None:
    gather = StaticGather()
    delayer = make_delayer(gather, token_usage_low_watermark=0.8)
    delayer.negotiate(False, 0.1)
    delayer.negotiate(True, 0.9)
    delayer.negotiate(True, 0.1)
    assert [row[:2] for row in gather.sent] == [(0, 0), (1, 0), (1, 1)]


def test_negotiate_advances_and_resets_state() -> None:
    clock = FakeClock()
    clock.now = NOW
    delayer = make_delayer(StaticGather([[[1, 0, 0, 0, 0]], [[0, 0, 0, 0, 0]]], position=(0, 0)),
                           clock, dp_size=2, max_delay_passes=3)
    reasons = []
    for _ in range(4):
        reasons.append(delayer.negotiate(True, 0.9).reason)
        clock.now += 0.01
    assert reasons == ["delay", "delay", "wait_timeout", "delay"]
    assert delayer.state == DelayerState(start_time=NOW + 0.03, delayed_count=1)


def test_bounded_delayer_sends_its_elapsed_wait() -> None:
    gather = StaticGather()
    clock = FakeClock()
    delayer = make_delayer(gather, clock, mode="bounded", queue_min_ratio=0.5)
    delayer.skip_first = False
    delayer.negotiate(True, 0.9, 10, 4, 100, 2)
    clock.now += 0.25
    delayer.negotiate(True, 0.9, 10, 4, 100, 2)
    assert [row[5] for row in gather.sent] == [0, 250_000]


def test_negotiate_rejects_a_table_of_the_wrong_shape() -> None:
    delayer = make_delayer(StaticGather([[[1, 0, 0, 0, 0]]]), dp_size=2)
    with pytest.raises(GatherShapeError, match=r"expected a \[2\]\[1\] table"):
        delayer.negotiate(True, 0.9)


def test_static_gather_rejects_a_position_outside_the_table() -> None:
    with pytest.raises(GatherShapeError, match="outside the table"):
        StaticGather([[[0]]], position=(1, 0))


# --- the single-pass executor --------------------------------------------------------------


def test_pass_negotiates_once_and_caches_the_answer() -> None:
    gather = StaticGather()
    single = DelayerPass(make_delayer(gather), token_usage=0.9)
    assert single.allow(True, running_batch=1, max_prefill_bs=1, max_running_requests=100)
    assert single.allow(False, running_batch=99) is True
    assert gather.sent == [(1, 0, 1, 1, 0)]
    assert single.result is not None and single.result.reason == "no_wait"


def test_finalize_without_negotiation_gathers_not_prefillable_zeros() -> None:
    gather = StaticGather()
    delayer = make_delayer(gather, token_usage_low_watermark=0.8)
    out = DelayerPass(delayer, token_usage=0.1).finalize(actual_prefill=False)
    assert gather.sent == [(0, 0, 0, 0, 0)]
    assert (out.allow, out.reason) == (True, "")
    assert delayer.outcomes == {"none": 1}


def test_finalize_after_negotiation_does_not_gather_again() -> None:
    gather = StaticGather()
    delayer = make_delayer(gather)
    single = DelayerPass(delayer, token_usage=0.9)
    single.allow(True)
    single.finalize(actual_prefill=True)
    assert len(gather.sent) == 1
    assert delayer.outcomes == {"no_wait": 1}


def test_pass_is_single_use() -> None:
    single = DelayerPass(make_delayer(), token_usage=0.9)
    single.finalize(actual_prefill=False)
    with pytest.raises(DelayerPassError, match="finalize called twice"):
        single.finalize(actual_prefill=False)
    with pytest.raises(DelayerPassError, match="allow after finalize"):
        single.allow(True)


# --- metrics and logging -------------------------------------------------------------------


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_metrics_observe_the_released_wait_only_when_prefill_ran() -> None:
    registry = CollectorRegistry()
    clock = FakeClock()
    gather = StaticGather([[[1, 0, 0, 0, 0]], [[0, 0, 0, 0, 0]]], position=(0, 0))
    delayer = make_delayer(gather, clock, DelayerMetrics(registry, 30), dp_size=2,
                           max_delay_passes=3)
    for actual in (False, False, True):  # delay, delay, wait_timeout after 1 s
        single = DelayerPass(delayer, 0.9)
        single.allow(True)
        single.finalize(actual_prefill=actual)
        clock.now += 0.5
    assert sample(registry, "pdlife_prefill_delayer_wait_forward_passes_count") == 1
    assert sample(registry, "pdlife_prefill_delayer_wait_forward_passes_sum") == 2
    assert sample(registry, "pdlife_prefill_delayer_wait_seconds_sum") == pytest.approx(1.0)
    outcome = "pdlife_prefill_delayer_outcomes_total"
    assert sample(registry, outcome, input_estimation="mixed", output_allow="false",
                  output_reason="delay", actual_execution="false") == 2
    assert sample(registry, outcome, input_estimation="mixed", output_allow="true",
                  output_reason="wait_timeout", actual_execution="true") == 1


def test_allowed_pass_without_prefill_is_counted_not_observed() -> None:
    registry = CollectorRegistry()
    delayer = make_delayer(metrics=DelayerMetrics(registry, 30))
    DelayerPass(delayer, 0.9).finalize(actual_prefill=False)
    assert sample(registry, "pdlife_prefill_delayer_wait_seconds_count") == 0
    assert sample(registry, "pdlife_prefill_delayer_outcomes_total", input_estimation="none",
                  output_allow="true", output_reason="", actual_execution="false") == 1


@pytest.mark.parametrize("passes", [0, -1])
def test_metrics_refuse_max_delay_passes_below_one(passes: int) -> None:
    with pytest.raises(DelayerConfigError, match=rf"max_delay_passes must be an integer >= 1 "
                                                 rf".*got {passes}$"):
        DelayerMetrics(CollectorRegistry(), passes)
    with pytest.raises(TypeError, match="max_delay_passes must be an integer, got True"):
        DelayerMetrics(CollectorRegistry(), True)


def test_wait_histograms_say_what_a_sample_is() -> None:
    """Their help said "a prefill waited", yet a pass that only continued a chunk adds a 0."""
    registry = CollectorRegistry()
    DelayerMetrics(registry, 30)
    helps = {m.name: m.documentation for m in registry.collect()}
    for name in ("pdlife_prefill_delayer_wait_forward_passes",
                 "pdlife_prefill_delayer_wait_seconds"):
        assert "ended by a pass that allowed prefill and ran a batch" in helps[name]
        assert "only continued a chunked prefill" in helps[name]


def test_forward_passes_buckets_follow_max_delay_passes() -> None:
    registry = CollectorRegistry()
    DelayerMetrics(registry, 30)
    bounds = sorted(
        float(s.labels["le"]) for m in registry.collect() for s in m.samples
        if s.name == "pdlife_prefill_delayer_wait_forward_passes_bucket"
    )
    assert bounds == [0.0, 5.0, 20.0, 29.0, float("inf")]


def test_debug_log_reports_forced_releases(caplog: pytest.LogCaptureFixture) -> None:
    gather = StaticGather([[[1, 0, 0, 0, 0]], [[0, 0, 0, 0, 0]]], position=(0, 0))
    delayer = make_delayer(gather, dp_size=2, max_delay_passes=1, debug_log=True)
    with caplog.at_level(logging.INFO, logger="scheduler.prefill.delayer"):
        single = DelayerPass(delayer, 0.9)
        single.allow(True)
        single.finalize(actual_prefill=True)
    assert "allowed prefill (wait_timeout)" in caplog.text
    caplog.clear()
    delayer = make_delayer(gather, dp_size=2, max_delay_passes=1)
    with caplog.at_level(logging.INFO, logger="scheduler.prefill.delayer"):
        single = DelayerPass(delayer, 0.9)
        single.allow(True)
        assert single.finalize(actual_prefill=True).reason == "wait_timeout"
    assert "allowed prefill" not in caplog.text
