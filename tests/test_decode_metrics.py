"""The decode peer's own metrics, outside the HTTP service: its registry by default, or one it
shares with a prefill scheduler."""

from __future__ import annotations

from prometheus_client import generate_latest

from kv.refusal import peer_refusal
from lifecycle import DecodeState, FailureReason, SamplingParams
from scheduler.decode import DecodeMetrics
from scheduler.decode.metrics import PREFILL_DRAINING
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.messages import NewRequest
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.stepping import step_until


def test_a_decode_peer_counts_its_answers_and_sets_its_gauges() -> None:
    pair = EmbeddedPair(PairConfig(model=ModelConfig.tiny(), prefill_pages=64, decode_pages=96,
                                   scheduler=SchedulerConfig(page_size=4)))
    try:
        metrics = pair.decode.metrics
        assert metrics.registry is not pair.prefill.metrics.registry
        value = metrics.registry.get_sample_value
        assert value("pdlife_decode_kv_pool_pages") == 96
        # Every outcome is exported at 0 before the first request ends.
        for labels in ({"state": "done", "reason": ""},
                       {"state": "failed", "reason": "transfer_failed"}):
            assert value("pdlife_decode_requests_finished_total", labels) == 0
            assert pair.prefill.metrics.registry.get_sample_value(
                "pdlife_requests_finished_total", labels) == 0
        for i, new_tokens in enumerate((3, 5, 7)):
            pair.submit(f"r{i}", [1 + i, 2, 3, 4, 5], SamplingParams(new_tokens, (), True))
        pair.submit("rejected", list(range(1, 200)), SamplingParams(300, (), True))
        outcomes = pair.run_until_done(["r0", "r1", "r2", "rejected"])
        assert value("pdlife_decode_requests_finished_total",
                     {"state": "done", "reason": ""}) == 3
        assert value("pdlife_decode_requests_finished_total",
                     {"state": "failed", "reason": "rejected"}) == 1
        assert value("pdlife_decode_output_tokens_total") == 3 + 5 + 7
        assert outcomes["rejected"].decode is not None
        assert value("pdlife_decode_peer_refusals_total", {"direction": "sent"}) == 1
        assert value("pdlife_decode_kv_pages_used") == 0
        assert value("pdlife_decode_requests", {"state": "decoding"}) == 0
    finally:
        pair.close()


def test_decode_metrics_share_a_registry_with_the_prefill_scheduler() -> None:
    pair = EmbeddedPair(PairConfig(model=ModelConfig.tiny(), prefill_pages=32, decode_pages=32))
    try:
        shared = DecodeMetrics(pair.prefill.metrics.registry)
        shared.kv_pages_total.set(32)
        text = generate_latest(pair.prefill.metrics.registry).decode()
        assert "pdlife_decode_kv_pool_pages 32.0" in text
        assert "pdlife_kv_pool_pages 32.0" in text
    finally:
        pair.close()


def test_finished_requests_do_not_pile_up_in_the_decode_deadline_heap() -> None:
    """Each admitted request pushes one waiting deadline; a finished request's entry is stale.
    The heap is rebuilt once stale entries outgrow the live requests by the slack, so its size
    follows the requests in flight, not the request rate times the waiting timeout."""
    pair = EmbeddedPair(PairConfig(model=ModelConfig.tiny(), prefill_pages=64, decode_pages=64,
                                   scheduler=SchedulerConfig(page_size=4)))
    try:
        pair.decode._deadlines.stale_slack = 4
        sizes = []
        for wave in range(6):
            rids = [f"w{wave}-{i}" for i in range(4)]
            for i, rid in enumerate(rids):
                pair.submit(rid, [1 + i, 2, 3], SamplingParams(2, (), True))
            outcomes = pair.run_until_done(rids)
            assert all(o.decode is not None and o.decode.ok for o in outcomes.values())
            sizes.append(len(pair.decode._deadlines))
        # 24 requests went through; without the rebuild the heap would hold 24 entries.
        assert max(sizes) <= 2 * 4 + 4 + 4, sizes
        assert len(pair.decode.lifecycle) == 0
    finally:
        pair.close()


def test_a_refusal_of_a_draining_prefill_counts_apart_from_other_refusals() -> None:
    """The prefill server refuses two rooms (as its HTTP front does, :mod:`kv.refusal`): one
    because it drains, one for a prompt it cannot take. Both decode halves fail
    ``bootstrap_failed``; the drain's counts under its own reason, which the decode alert leaves
    out (docs/prometheus-alerts.yml), the other as ``bootstrap_failed``."""
    pair = EmbeddedPair(PairConfig(model=ModelConfig.tiny(), prefill_pages=32, decode_pages=32,
                                   scheduler=SchedulerConfig(page_size=4)))
    try:
        why = {41: peer_refusal("draining", 503, "the server is draining (shutting down)"),
               42: peer_refusal("prompt_too_long", 400, "the prompt has 140 tokens")}
        for room, reason in why.items():
            pair.prefill.refuse_room(pair.bootstrap_host, pair.bootstrap_port, room, reason)
            pair.decode.submit(NewRequest(
                f"r{room}", (1, 2, 3, 4), bootstrap_host=pair.bootstrap_host,
                bootstrap_port=pair.bootstrap_port, bootstrap_room=room,
                sampling=SamplingParams(2, (), True)))
        answers = pair.decode_responses
        step_until(pair.step, lambda: len(answers) == 2, 30, lambda: f"answered: {answers}")
        for room, reason in why.items():
            answer = answers[f"r{room}"]
            assert (answer.state, answer.reason) == (DecodeState.FAILED,
                                                     FailureReason.BOOTSTRAP_FAILED), answer
            assert reason in answer.detail, answer.detail
        value = pair.decode.metrics.registry.get_sample_value
        finished = "pdlife_decode_requests_finished_total"
        assert value(finished, {"state": "failed", "reason": PREFILL_DRAINING}) == 1
        assert value(finished, {"state": "failed", "reason": "bootstrap_failed"}) == 1
        assert value("pdlife_decode_peer_refusals_total", {"direction": "received"}) == 2
    finally:
        pair.close()


def test_the_draining_reason_is_exported_at_0_before_the_first() -> None:
    value = DecodeMetrics().registry.get_sample_value
    assert value("pdlife_decode_requests_finished_total",
                 {"state": "failed", "reason": PREFILL_DRAINING}) == 0
