"""The prefill scheduler and decode peer together: aborts and failures across the two sides."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import attrs
import pytest

from lifecycle import DecodeState, FailureReason, PrefillState, SamplingParams
from lifecycle.testing import FakeClock
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.stepping import step_until


def make_pair_config() -> PairConfig:
    return PairConfig(model=ModelConfig.tiny(), prefill_pages=256, decode_pages=256,
                      scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16,
                                                check_invariants=True))


def make_pair() -> EmbeddedPair:
    return EmbeddedPair(make_pair_config())


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
        # The decode half, which never got its KV, ends as an abort too (the client's), not as
        # a failed transfer, which a router would retry.
        assert out.decode.reason is FailureReason.ABORTED, out.decode
        assert out.decode.http_status == 200
        assert "peer refused: aborted (200): aborted by the client" in out.decode.detail, (
            out.decode.detail)
        assert pair.prefill_pool.allocator.available() == 256
        assert pair.decode_pool.allocator.available() == 256
    finally:
        pair.close()


def test_a_request_id_is_the_pairs_until_its_outcome_is_handed_over():
    """A live id is refused at submit (it once crashed the pair's response hook); an outcome
    handed over is forgotten, so the id may come back and a long-lived pair does not grow."""
    pair = make_pair()
    try:
        for round_ in range(3):
            pair.submit("a", [1, 2, 3, round_], SamplingParams(max_new_tokens=3))
            with pytest.raises(ValueError, match="request id 'a' is in use"):
                pair.submit("a", [4, 5], SamplingParams(max_new_tokens=3))
            out = pair.run_until_done(["a"])["a"]
            assert out.prefill.ok and out.decode is not None and out.decode.ok, out
            assert pair.prefill_responses == {} and pair.decode_responses == {}
        pair.prefill.check_invariants()
    finally:
        pair.close()


def test_a_wrong_type_at_submit_raises_there_and_the_pair_serves_on():
    """A prompt of text or a dict for sampling reached the engine's pass, whose TypeError ended
    the pair's loop for every request (and close() raised it again)."""
    pair = make_pair()
    try:
        pair.submit("good", [1, 2, 3], SamplingParams(max_new_tokens=3))
        with pytest.raises(TypeError, match="token ids must be a sequence of integers, got "
                                            "'hello'"):
            pair.submit("bad", "hello", SamplingParams(max_new_tokens=3))
        with pytest.raises(TypeError, match=r"sampling must be a SamplingParams, got "
                                            r"{'max_new_tokens': 4} \(dict\)"):
            pair.submit("bad", [1], {"max_new_tokens": 4})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="rid must be a string, got 7"):
            pair.submit(7, [1], SamplingParams())  # type: ignore[arg-type]
        pair.submit("bad", [4, 5], SamplingParams(max_new_tokens=2))  # nothing was recorded
        out = pair.run_until_done(["good", "bad"])
        assert all(o.answer.ok for o in out.values()), out
    finally:
        pair.close()


def test_a_request_beyond_the_models_context_is_refused_on_both_sides():
    """It was computed, then failed on prefill as internal (a 500) past the context, or on
    decode after a few tokens when only the answer went beyond it."""
    cfg = PairConfig(model=attrs.evolve(ModelConfig.tiny(), max_position=64),
                     prefill_pages=64, decode_pages=64,
                     scheduler=SchedulerConfig(page_size=4, check_invariants=True))
    pair = EmbeddedPair(cfg)
    try:
        pair.submit("long", list(range(60)), SamplingParams(max_new_tokens=6))
        pair.submit("fits", list(range(60)), SamplingParams(max_new_tokens=5))
        out = pair.run_until_done(["long", "fits"])
        why = ("request 'long': prompt (60 tokens) + max_new_tokens (6) - 1 exceeds the "
               "model's context of 64 positions")
        for side in (out["long"].prefill, out["long"].decode):
            assert (side.reason, side.detail) == (FailureReason.REJECTED, why), side
        assert out["long"].answer is out["long"].prefill
        assert out["fits"].answer is out["fits"].decode
        assert len(out["fits"].decode.output_ids) == 5, out["fits"]
    finally:
        pair.close()


def test_a_room_is_the_pairs_until_its_outcome_is_handed_over_and_never_0():
    """Refused at submit, as a live id is (both sides refused them later, with a 400 on one
    side and a 500 on the other for room 0); the pair's own rooms skip those given."""
    pair = make_pair()
    try:
        pair.submit("a", [1, 2, 3], SamplingParams(max_new_tokens=2), room=2)
        with pytest.raises(ValueError, match="bootstrap room 2 is in use"):
            pair.submit("b", [4, 5], SamplingParams(max_new_tokens=2), room=2)
        with pytest.raises(ValueError, match="bootstrap room 0 marks an empty metadata row"):
            pair.submit("b", [4, 5], SamplingParams(max_new_tokens=2), room=0)
        for beyond in (-1, 1 << 64):  # what a metadata row cannot carry (it failed a pass)
            with pytest.raises(ValueError, match=r"bootstrap_room must be in 0 \.\. 2\*\*64"):
                pair.submit("b", [4, 5], SamplingParams(max_new_tokens=2), room=beyond)
        pair.submit("b", [4, 5], SamplingParams(max_new_tokens=2))  # room 1
        pair.submit("c", [6, 7], SamplingParams(max_new_tokens=2))  # room 3: 2 is a's
        out = pair.run_until_done(["a", "b", "c"])
        assert all(o.prefill.ok and o.decode is not None and o.decode.ok for o in out.values())
        pair.submit("d", [8], SamplingParams(max_new_tokens=2), room=2)  # handed over: free
        assert pair.run_until_done(["d"])["d"].decode.ok
    finally:
        pair.close()


def test_a_loop_stepping_the_pair_itself_takes_answered_outcomes():
    pair = make_pair()
    try:
        with pytest.raises(ValueError, match=r"\['typo'\] were not submitted"):
            pair.run_until_done(["typo"], timeout=60)  # at once, not after the timeout
        with pytest.raises(ValueError, match=r"\['typo'\] were not submitted"):
            pair.take(["typo"])
        pair.submit("a", [1, 2, 3], SamplingParams(max_new_tokens=2))
        pair.submit("b", [4, 5, 6], SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert pair.take(["a", "b"]) == {}  # nothing answered yet
        while "a" not in pair.decode_responses or "a" not in pair.prefill_responses:
            pair.step()
        taken = pair.take(["a", "b"])
        assert list(taken) == ["a"] and taken["a"].decode.ok
        assert "a" not in pair.decode_responses
        pair.submit("a", [7, 8], SamplingParams(max_new_tokens=2))  # the id is free again
        out = pair.run_until_done(["a", "b"])
        assert out["a"].decode.ok and len(out["b"].decode.output_ids) == 40
    finally:
        pair.close()


def test_run_until_done_without_idle_returns_once_its_own_requests_are_answered():
    pair = make_pair()
    try:
        pair.submit("long", [1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True))
        pair.submit("short", [4, 5, 6], SamplingParams(max_new_tokens=2, ignore_eos=True))
        short = pair.run_until_done(["short"], idle=False)["short"]
        assert short.decode is not None and len(short.decode.output_ids) == 2
        assert pair.decode.lifecycle.get("long") is not None  # still decoding
        long = pair.run_until_done(["long"])["long"]
        assert long.decode is not None and len(long.decode.output_ids) == 200
    finally:
        pair.close()


def test_a_prompt_id_outside_the_vocabulary_is_refused_alone():
    """In one batch with others it failed them all (the model raised for the whole batch)."""
    pair = make_pair()
    vocab = pair.model.config.vocab_size
    try:
        pair.submit("oov", [1, 2, vocab], SamplingParams(max_new_tokens=3))
        pair.submit("negative", [1, -5, 3], SamplingParams(max_new_tokens=3))
        pair.submit("ok", [1, 2, 3], SamplingParams(max_new_tokens=3))
        out = pair.run_until_done(["oov", "negative", "ok"])
        for rid, got in (("oov", f"{vocab}"), ("negative", "-5")):
            prefill = out[rid].prefill
            assert prefill.reason is FailureReason.REJECTED and prefill.http_status == 400
            assert f"token ids must be in 0..{vocab - 1}, got {got}" in prefill.detail
            assert out[rid].decode is not None and not out[rid].decode.ok
        assert out["ok"].decode is not None and out["ok"].decode.ok, out["ok"]
        pair.submit("empty", [], SamplingParams(max_new_tokens=3))
        empty = pair.run_until_done(["empty"])["empty"]
        for side in (empty.prefill, empty.decode):
            assert side.reason is FailureReason.REJECTED, side
        for side in (empty.prefill, empty.decode):  # both sides say it alike
            assert side.detail == "the prompt is empty; it needs at least one token", side
        assert pair.prefill_pool.allocator.available() == 256
        assert pair.decode_pool.allocator.available() == 256
    finally:
        pair.close()


def test_close_answers_live_requests_shutdown_and_refuses_later_submits():
    pair = make_pair()
    pair.submit("done", [1, 2], SamplingParams(max_new_tokens=2))
    pair.run_until_done(["done"])
    for i in range(3):
        pair.submit(f"live{i}", list(range(40)), SamplingParams(max_new_tokens=50))
    for _ in range(3):
        pair.step()
    pair.close()
    for i in range(3):
        prefill, decode = pair.prefill_responses[f"live{i}"], pair.decode_responses[f"live{i}"]
        assert decode.reason is FailureReason.SHUTDOWN and decode.http_status == 503, decode
        assert "shutting down" in decode.detail
        # Its KV may have reached decode already: the prefill side then ended it DONE.
        assert prefill.ok or prefill.reason is FailureReason.SHUTDOWN, prefill
    assert any(not pair.prefill_responses[f"live{i}"].ok for i in range(3))
    assert pair.prefill_pool.allocator.available() == 256
    assert pair.decode_pool.allocator.available() == 256
    with pytest.raises(RuntimeError, match="this EmbeddedPair is closed"):
        pair.submit("late", [1, 2], SamplingParams(max_new_tokens=2))
    pair.close()  # a second close does nothing


def test_requests_submitted_from_many_threads_each_get_a_room_and_an_answer():
    pair = make_pair()
    rids = [f"t{t}-{i}" for t in range(4) for i in range(25)]

    def submit(t: int) -> None:
        for i in range(25):
            pair.submit(f"t{t}-{i}", [1 + t, 2 + i], SamplingParams(max_new_tokens=2))

    try:
        threads = [threading.Thread(target=submit, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        out = pair.run_until_done(rids)
        assert all(o.decode is not None and o.decode.ok for o in out.values()), [
            (r, o.prefill.detail) for r, o in out.items() if not o.prefill.ok]
    finally:
        pair.close()


def test_a_pass_a_signal_interrupts_stops_every_later_pass_and_close_still_releases(
        caplog: pytest.LogCaptureFixture) -> None:
    """KeyboardInterrupt lands anywhere in a pass (here: in the decode side's detokenizer, as
    Ctrl-C would on the stepping thread): that side refuses every later pass, naming it, and
    close() steps nothing, warns naming what it leaves unanswered and closes the engines."""
    interrupt = threading.Event()

    def detokenize(ids: Sequence[int]) -> str:
        if interrupt.is_set():
            raise KeyboardInterrupt
        return "".join(chr(65 + i % 26) for i in ids)

    cfg = PairConfig(model=ModelConfig.tiny(), prefill_pages=64, decode_pages=64,
                     scheduler=SchedulerConfig(page_size=4))
    pair = EmbeddedPair(cfg, detokenize=detokenize)
    pair.submit("r", [1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True,
                                                stop=["never"]))
    while "r" not in pair.prefill_responses:
        pair.step()
    interrupt.set()
    with pytest.raises(KeyboardInterrupt):
        while True:
            pair.step()
    assert isinstance(pair.interrupted, KeyboardInterrupt)
    with pytest.raises(RuntimeError, match="a pass was interrupted by KeyboardInterrupt"):
        pair.step()
    with pytest.raises(RuntimeError, match=r"interrupted by KeyboardInterrupt.*close it"):
        pair.submit("refused", [1, 2], SamplingParams(max_new_tokens=2))
    with caplog.at_level(logging.WARNING, logger="scheduler.embedded"):
        pair.close()
    assert "without answering 1 live requests (r)" in caplog.text, caplog.text
    with pytest.raises(RuntimeError, match="this EmbeddedPair is closed"):
        pair.submit("late", [1, 2], SamplingParams(max_new_tokens=2))


def test_close_while_another_thread_is_in_a_pass_raises_having_changed_nothing() -> None:
    """A close() from a thread that does not step the pair, while the stepping thread is in
    a pass, is refused at once; the pair is left as it was, and a close() on the stepping
    thread then answers everything."""
    in_pass, go_on = threading.Event(), threading.Event()

    def detokenize(ids: Sequence[int]) -> str:
        in_pass.set()
        go_on.wait(30)
        return ""

    cfg = PairConfig(model=ModelConfig.tiny(), prefill_pages=64, decode_pages=64,
                     scheduler=SchedulerConfig(page_size=4))
    pair = EmbeddedPair(cfg, detokenize=detokenize)
    pair.submit("r", [1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True,
                                                stop=["never"]))
    refused: list[BaseException] = []

    def stepper() -> None:
        while not in_pass.is_set():
            pair.step()

    thread = threading.Thread(target=stepper)
    thread.start()
    assert in_pass.wait(30)
    try:
        pair.close()
    except RuntimeError as exc:
        refused.append(exc)
    go_on.set()
    thread.join(30)
    assert refused and "close() called on thread 'MainThread' while thread" in str(refused[0])
    pair.submit("after", [4, 5], SamplingParams(max_new_tokens=2))  # not closed
    pair.close()
    assert pair.decode_responses["r"].reason is FailureReason.SHUTDOWN
    assert pair.prefill_pool.allocator.available() == 64
    assert pair.decode_pool.allocator.available() == 64


def test_a_prefill_half_that_times_out_waiting_for_decode_pages_fails_its_decode_half_so():
    """A decode pool full of one long answer: the next request's decode half waits for pages,
    its prefill half for the destination, until the bootstrap timeout. A front end that
    aborts the decode half with the prefill half's failure, before the decode side's next
    pass (as a colocated server does), has it fail as that refusal says
    (``bootstrap_failed``, naming the timeout), not as a client's abort."""
    clock = FakeClock()
    cfg = PairConfig(model=ModelConfig.tiny(), prefill_pages=64, decode_pages=4,
                     scheduler=SchedulerConfig(page_size=4, bootstrap_timeout=30.0))
    pair = EmbeddedPair(cfg, clock=clock)
    try:
        pair.submit("long", [1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True))
        while (req := pair.decode.lifecycle.get("long")) is None or (
                req.state is not DecodeState.DECODING):
            pair.step()
        pair.submit("next", [4, 5, 6, 7, 8], SamplingParams(max_new_tokens=4))
        while (req := pair.decode.lifecycle.get("next")) is None or (
                req.state is not DecodeState.PREALLOC):
            pair.step()
        clock.now += 31.0
        pair.prefill.step()
        failed = pair.prefill_responses["next"]
        assert failed.reason is FailureReason.BOOTSTRAP_TIMEOUT, failed
        pair.decode.abort("next", peer=failed.refusal())
        pair.decode.step()
        decode = pair.decode_responses["next"]
        assert decode.reason is FailureReason.BOOTSTRAP_FAILED, decode
        assert "peer refused: bootstrap_timeout (500): " in decode.detail, decode.detail
        assert pair.run_until_done(["next", "long"])["long"].decode.ok
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["local", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_a_prefill_abort_after_the_decode_half_received_everything_lets_it_finish(
        backend: str) -> None:
    """Once every page and the metadata row reached the decode half (it decodes), a client's
    abort that reaches only the prefill half ends that half alone: the decode half finishes,
    whether the prefill's word reaches it through the transfer (stepped side by side, as two
    servers are) or from a front end that aborts the decode half with the prefill's failure."""
    pair = EmbeddedPair(attrs.evolve(make_pair_config(), backend=backend))
    try:
        pair.submit("a", list(range(30)), SamplingParams(max_new_tokens=20, ignore_eos=True))
        while (req := pair.prefill.lifecycle.get("a")) is None or (
                req.state is not PrefillState.TRANSFERRING):
            pair.step()
        step_until(pair.decode.step, lambda: (d := pair.decode.lifecycle.get("a")) is not None
                   and d.state is DecodeState.DECODING, 30)
        assert pair.prefill.lifecycle.get("a").state is PrefillState.TRANSFERRING  # type: ignore[union-attr]
        pair.prefill.abort("a")
        step_until(pair.prefill.step, lambda: "a" in pair.prefill_responses, 30)
        for _ in range(3):  # the refusal's way to the decode half, if any
            pair.decode.step()
        pair.decode.abort("a", peer=pair.prefill_responses["a"].refusal())
        out = pair.run_until_done(["a"])["a"]
        assert out.decode.ok and len(out.decode.output_ids) == 20, out.decode
        assert out.prefill.reason is FailureReason.ABORTED or out.prefill.ok, out.prefill
        assert pair.prefill_pool.allocator.available() == 256
        assert pair.decode_pool.allocator.available() == 256
    finally:
        pair.close()
