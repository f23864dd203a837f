"""The prefill scheduler and decode peer together: aborts and failures across the two sides."""

from __future__ import annotations

from lifecycle import FailureReason, PrefillState, SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig


def make_pair() -> EmbeddedPair:
    cfg = PairConfig(model=ModelConfig.tiny(), prefill_pages=256, decode_pages=256,
                     scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16,
                                               check_invariants=True))
    return EmbeddedPair(cfg)


def test_an_abort_from_decode_is_an_abort_on_prefill_too():
    pair = make_pair()
    try:
        pair.submit("a", list(range(200)), SamplingParams(max_new_tokens=4))
        # Step until prefill is computing the request chunk by chunk, then abort on decode only.
        while (req := pair.prefill.lifecycle.get("a")) is None or req.state is not (
            PrefillState.FORWARD
        ):
            pair.step()
        pair.decode.abort("a")
        out = pair.run_until_done(["a"])["a"]
        assert out.decode is not None and out.decode.reason is FailureReason.ABORTED
        assert out.prefill.reason is FailureReason.ABORTED
        assert out.prefill.http_status == 200
        assert "decode peer" in out.prefill.detail
        assert pair.prefill_pool.allocator.available() == 256
        assert pair.decode_pool.allocator.available() == 256
    finally:
        pair.close()


def test_a_prefill_failure_releases_both_sides():
    pair = make_pair()
    try:
        pair.submit("a", list(range(100)), SamplingParams(max_new_tokens=4))
        while (req := pair.prefill.lifecycle.get("a")) is None or req.state is not (
            PrefillState.FORWARD
        ):
            pair.step()
        pair.prefill.abort("a")
        out = pair.run_until_done(["a"])["a"]
        assert out.prefill.reason is FailureReason.ABORTED
        assert out.decode is not None and not out.decode.ok
        assert pair.prefill_pool.allocator.available() == 256
        assert pair.decode_pool.allocator.available() == 256
    finally:
        pair.close()
