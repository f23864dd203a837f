"""An EmbeddedPair inside a service of one's own (docs/embedding.md, "Serving from one
process"): stepped by an EngineLoop, its answers taken and its streams followed on the loop's
thread, its metrics in one registry."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lifecycle import DecodeState, FailureReason, PrefillState, SamplingParams
from scheduler.embedded import EmbeddedPair, Outcome, PairConfig
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.engine_loop import EngineLoop
from tests.service_harness import wait_for

MODEL = ModelConfig.tiny()


def make_pair(registry: CollectorRegistry | None = None) -> EmbeddedPair:
    cfg = PairConfig(model=MODEL, prefill_pages=64, decode_pages=96,
                     scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16,
                                               check_invariants=True))
    return EmbeddedPair(cfg, registry=registry)


class Follower:
    """What a service does on the engine thread: push the tokens the decode records grew,
    then take the outcomes answered on both sides (their last tokens come only there)."""

    def __init__(self, pair: EmbeddedPair) -> None:
        self.pair = pair
        self.lock = threading.Lock()
        self.following: set[str] = set()
        self.streamed: dict[str, list[int]] = {}  # engine thread only
        self.outcomes: dict[str, Outcome] = {}

    def submit(self, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        with self.lock:  # submitted before the engine thread can look for it
            self.pair.submit(rid, prompt, sampling)
            self.following.add(rid)

    def push(self) -> None:
        with self.lock:
            rids = list(self.following)
        for rid in rids:
            record = self.pair.decode.lifecycle.get(rid)
            if record is not None:
                seen = self.streamed.setdefault(rid, [])
                seen += record.output_ids[len(seen):]

    def after_pass(self) -> None:
        self.push()
        with self.lock:
            rids = list(self.following)
        taken = self.pair.take(rids)
        with self.lock:
            self.following.difference_update(taken)
            self.outcomes.update(taken)


def test_an_engine_loop_steps_a_pair_and_streams_its_tokens_on_the_loops_thread() -> None:
    pair = make_pair()
    follower = Follower(pair)
    pair.decode.on_first_tokens = follower.push
    crashed: list[BaseException] = []
    loop = EngineLoop([pair], on_crash=crashed.append, after_pass=follower.after_pass)
    loop.start()
    prompts = {f"r{i}": [1 + i, 2, 3, 4 + i] * (1 + i) for i in range(4)}
    try:
        for rid, prompt in prompts.items():
            follower.submit(rid, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
            loop.wake()
        wait_for(lambda: len(follower.outcomes) == len(prompts) or bool(crashed), 60,
                 "every outcome taken on the engine thread")
        assert not crashed, crashed
        wait_for(pair.idle, 60, "the pair idle once every request was taken")
    finally:
        loop.stop()
    reference = ReferenceModel(LlamaModel(MODEL))
    for rid, prompt in prompts.items():
        out = follower.outcomes[rid]
        assert out.decode.state == DecodeState.DONE and out.prefill.ok, out
        output = list(out.decode.output_ids)
        assert output == reference.generate(prompt, 12)
        streamed = follower.streamed[rid]
        # The records showed every token but the last, in order; the Outcome has them all.
        assert streamed == output[:len(streamed)] and 0 < len(streamed) < len(output), (
            streamed, output)
    assert pair.prefill_responses == {} and pair.decode_responses == {}
    pair.close()
    for side in (pair.prefill, pair.decode):
        assert side.pool.allocator.available() == side.pool.num_pages


def test_a_request_aborted_on_prefill_alone_under_an_engine_loop_ends_on_both_sides() -> None:
    """Stepping the pair (not run_until_done) is enough: the KV layer ends the decode half."""
    pair = make_pair()
    follower = Follower(pair)
    aborted: list[str] = []

    def after_pass() -> None:  # abort mid-prefill, between two chunks of the prompt
        record = pair.prefill.lifecycle.get("a")
        if not aborted and record is not None and record.state is PrefillState.FORWARD:
            pair.prefill.abort("a")
            aborted.append("a")
        follower.after_pass()

    crashed: list[BaseException] = []
    loop = EngineLoop([pair], on_crash=crashed.append, after_pass=after_pass)
    loop.start()
    try:
        follower.submit("a", list(range(1, 120)), SamplingParams(max_new_tokens=40))
        loop.wake()
        wait_for(lambda: "a" in follower.outcomes or bool(crashed), 60, "both sides' answers")
        assert not crashed, crashed
        wait_for(pair.idle, 60, "the pair idle")
    finally:
        loop.stop()
    out = follower.outcomes["a"]
    assert aborted and out.prefill.reason is FailureReason.ABORTED, out.prefill
    assert out.decode.reason is FailureReason.ABORTED, out.decode
    assert "peer refused: aborted (200)" in out.decode.detail, out.decode.detail
    pair.close()
    for side in (pair.prefill, pair.decode):
        assert side.pool.allocator.available() == side.pool.num_pages


def test_a_pair_given_a_registry_puts_both_sides_metrics_in_it() -> None:
    registry = CollectorRegistry()
    pair = make_pair(registry)
    other_registry = CollectorRegistry()
    other = make_pair(other_registry)
    try:
        assert pair.prefill.metrics.registry is registry
        assert pair.decode.metrics.registry is registry
        value = registry.get_sample_value
        assert value("pdlife_kv_pool_pages") == 64
        assert value("pdlife_decode_kv_pool_pages") == 96
        for i in range(2):
            pair.submit(f"r{i}", [1 + i, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True))
        pair.run_until_done(["r0", "r1"])
        other.submit("x", [4, 5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
        other.run_until_done(["x"])
        done = {"state": "done", "reason": ""}
        text = generate_latest(registry).decode()
        assert 'pdlife_requests_finished_total{reason="",state="done"} 2.0' in text
        assert 'pdlife_decode_requests_finished_total{reason="",state="done"} 2.0' in text
        assert value("pdlife_decode_output_tokens_total") == 10
        # Another pair with a registry of its own counts its own requests alone.
        assert other_registry.get_sample_value("pdlife_requests_finished_total", done) == 1
        assert other_registry.get_sample_value("pdlife_decode_output_tokens_total") == 3
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            make_pair(registry)  # one pair per registry
        assert value("pdlife_decode_requests_finished_total", done) == 2
    finally:
        pair.close()
        other.close()
