"""The model-runner protocol of ``scheduler/runner.py``: what a runner of one's own must have,
and how the scheduler tells a runner that lacks something from one that has it."""

from __future__ import annotations

import pytest
import torch

from kv.fake import FakeKVManager
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pool import KVPool
from lifecycle import FailureReason, SamplingParams
from lifecycle.testing import FakeClock
from scheduler.decode import DecodePeer
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake
from scheduler.messages import FAKE_BOOTSTRAP_HOST, DecodeResponse, NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch, LogitsRunner, ModelRunner
from scheduler.stepping import step_until
from scheduler.testing.fakes import ForwardOnly

MODEL = LlamaModel(ModelConfig.tiny(seed=3))


def paged() -> PagedModelRunner:
    return PagedModelRunner(MODEL, MODEL.make_pool(num_pages=16, page_size=4))


class NoPool:
    def forward(self, batch: ForwardBatch) -> list[int]:
        return []


def test_isinstance_tells_a_model_runner_and_a_logits_runner() -> None:
    pool = MODEL.make_pool(num_pages=4, page_size=4)
    reference = PagedModelRunner(MODEL, pool)
    plain = ForwardOnly(reference)
    assert isinstance(reference, ModelRunner) and isinstance(reference, LogitsRunner)
    assert isinstance(plain, ModelRunner) and not isinstance(plain, LogitsRunner)
    assert not isinstance(NoPool(), ModelRunner)
    assert not isinstance(torch.zeros(1), ModelRunner)


class LogitsNoVocab(ForwardOnly):
    """``logits`` without the ``vocab_size`` a logits runner needs."""

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        return self.inner.logits(batch)


class ForwardWithVocab(ForwardOnly):
    """``forward`` alone, with the optional ``vocab_size``."""

    vocab_size = MODEL.config.vocab_size


def serve(runner: ModelRunner, requests: dict[str, NewRequest]) -> dict[str, Response]:
    """Each request through a prefill scheduler over ``runner`` (the fake backend); the
    answers by id, once every page is back."""
    clock, responses = FakeClock(), list[Response]()
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=4, chunked_prefill_size=8, check_invariants=True),
        runner=runner, kv=FakeKVManager(clock=clock), metadata=MetadataBuffers(4),
        slots=SlotAllocator(4), clock=clock, on_response=responses.append)
    for req in requests.values():
        sched.submit(req)
    sched.run_until(lambda: len(responses) == len(requests) and sched.idle())
    sched.check_invariants()
    assert runner.pool.allocator.available() == runner.pool.num_pages
    sched.close()
    return {r.rid: r for r in responses}


def request(rid: str, room: int, prompt: tuple[int, ...] = (1, 2, 3),
            sampling: SamplingParams | None = None) -> NewRequest:
    return NewRequest(rid, prompt, bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=room,
                      sampling=sampling or SamplingParams())


def test_a_runner_with_logits_but_no_vocab_size_is_told_which_attribute_it_lacks() -> None:
    runner = LogitsNoVocab(paged())
    assert not isinstance(runner, LogitsRunner)
    out = serve(runner, {"sampled": request("sampled", 1, sampling=SamplingParams(
        temperature=0.5, seed=1)), "plain": request("plain", 2)})
    refused = out["sampled"]
    assert refused.reason is FailureReason.REJECTED and refused.http_status == 400
    assert "no vocab_size attribute, which a logits runner needs" in refused.detail, refused
    assert out["plain"].ok

    # A runner without logits at all is told that it serves greedy requests only.
    out = serve(ForwardOnly(paged()), {
        "sampled": request("sampled", 1, sampling=SamplingParams(temperature=0.5, seed=1))})
    assert "serves only greedy requests without logprobs" in out["sampled"].detail


def test_a_runner_that_declares_vocab_size_has_its_prompts_checked_against_it() -> None:
    """Without logits too: an id outside the vocabulary is refused alone (400), where the
    model would have failed its whole batch."""
    vocab = MODEL.config.vocab_size
    out = serve(ForwardWithVocab(paged()), {
        "outside": request("outside", 1, prompt=(1, vocab, 2)), "inside": request("inside", 2)})
    assert out["outside"].reason is FailureReason.REJECTED, out["outside"]
    assert f"token ids must be in 0..{vocab - 1}, got {vocab}" in out["outside"].detail
    assert out["inside"].ok


class Short(ForwardOnly):
    """Answers one token too few while ``short`` is set."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(PagedModelRunner(MODEL, pool))
        self.short = True

    def forward(self, batch: ForwardBatch) -> list[int]:
        tokens = super().forward(batch)
        return tokens[:-1] if self.short else tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_a_forward_that_answers_the_wrong_count_fails_its_batch_and_the_loop_goes_on(
        overlap: bool) -> None:
    runner = Short(MODEL.make_pool(num_pages=16, page_size=4))
    clock, responses = FakeClock(), list[Response]()
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=4, check_invariants=True), runner=runner,
        kv=FakeKVManager(clock=clock), metadata=MetadataBuffers(2), slots=SlotAllocator(2),
        clock=clock, on_response=responses.append, overlap=overlap)
    sched.submit(request("a", 1, prompt=tuple(range(1, 10))))
    sched.run_until(lambda: len(responses) == 1 and sched.idle())
    failed = responses[0]
    assert failed.reason is FailureReason.INTERNAL and failed.http_status == 500, failed
    assert "the model runner answered 0 tokens for a batch of 1 requests" in failed.detail
    sched.check_invariants()
    assert runner.pool.allocator.available() == runner.pool.num_pages
    assert sched.slots.available() == sched.slots.num_slots

    runner.short = False  # the loop went on: the next request is served
    sched.submit(request("b", 2, prompt=tuple(range(1, 10))))
    sched.run_until(lambda: len(responses) == 2 and sched.idle())
    assert responses[1].ok, responses[1]
    assert runner.pool.allocator.available() == runner.pool.num_pages
    sched.close()


def decode_peer(runner: ModelRunner) -> tuple[DecodePeer, LocalPrefillFake,
                                                list[DecodeResponse]]:
    """A decode peer over ``runner`` for the fake host, whose requests have their prompt
    computed by a correct runner over the same pool; the peer, the host, the answers."""
    metadata = MetadataBuffers(4)
    fake = LocalPrefillFake(PagedModelRunner(MODEL, runner.pool), metadata)
    answers: list[DecodeResponse] = []
    peer = DecodePeer(runner=runner, kv=DecodeKVRouter(fake=fake), metadata=metadata,
                      slots=SlotAllocator(4), on_response=answers.append)
    return peer, fake, answers


def test_a_decode_step_that_answers_the_wrong_count_fails_its_batch_and_the_peer_goes_on() -> None:
    pool = MODEL.make_pool(num_pages=32, page_size=4)
    runner = Short(pool)
    peer, fake, answers = decode_peer(runner)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)

    def decode(rid: str, room: int) -> DecodeResponse:
        fake.expect(room, rid, (1, 2, 3), params)
        peer.submit(request(rid, room, sampling=params))
        step_until(peer.step, lambda: any(a.rid == rid for a in answers) and peer.idle(), 30.0,
                   lambda: f"answered: {answers}")
        peer.check_invariants()
        assert pool.allocator.available() == pool.num_pages
        return next(a for a in answers if a.rid == rid)

    failed = decode("a", 1)
    assert failed.reason is FailureReason.INTERNAL, failed
    assert "the model runner answered 0 tokens for a batch of 1 requests" in failed.detail
    runner.short = False
    assert decode("b", 2).ok


class Raising(ForwardOnly):
    """Raises ``error`` from its forwards while it is set."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(PagedModelRunner(MODEL, pool))
        self.error: Exception | None = None

    def forward(self, batch: ForwardBatch) -> list[int]:
        if self.error is not None:
            raise self.error
        return super().forward(batch)


OUT_OF_MEMORY = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
DEVICE_ERRORS = pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),  # torch before 2.8
], ids=["accelerator-error", "runtime-error"])


@DEVICE_ERRORS
@pytest.mark.parametrize("overlap", [False, True])
def test_a_device_error_leaves_the_prefill_step_where_running_out_of_memory_fails_a_batch(
        overlap: bool, error: Exception) -> None:
    runner = Raising(MODEL.make_pool(num_pages=16, page_size=4))
    clock, responses = FakeClock(), list[Response]()
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=4, check_invariants=True), runner=runner,
        kv=FakeKVManager(clock=clock), metadata=MetadataBuffers(2), slots=SlotAllocator(2),
        clock=clock, on_response=responses.append, overlap=overlap)
    runner.error = OUT_OF_MEMORY
    sched.submit(request("a", 1, prompt=tuple(range(1, 10))))
    sched.run_until(lambda: len(responses) == 1 and sched.idle())
    assert responses[0].reason is FailureReason.INTERNAL, responses[0]
    assert "CUDA out of memory" in responses[0].detail

    runner.error = error
    sched.submit(request("b", 2, prompt=tuple(range(1, 10))))
    with pytest.raises(type(error), match=r"^CUDA error: "):
        sched.run_until(lambda: len(responses) == 2, timeout=30.0)
    assert len(responses) == 1  # "b" is answered by whoever ran the loop (a service: 500)
    sched.close()


@DEVICE_ERRORS
def test_a_device_error_leaves_the_decode_step(error: Exception) -> None:
    runner = Raising(MODEL.make_pool(num_pages=32, page_size=4))
    peer, fake, answers = decode_peer(runner)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    runner.error = OUT_OF_MEMORY
    fake.expect(1, "a", (1, 2, 3), params)
    peer.submit(request("a", 1, sampling=params))
    step_until(peer.step, lambda: bool(answers) and peer.idle(), 30.0, lambda: f"{answers}")
    assert answers[0].reason is FailureReason.INTERNAL and "CUDA out of memory" in \
        answers[0].detail, answers

    runner.error = error
    fake.expect(2, "b", (1, 2, 3), params)
    peer.submit(request("b", 2, sampling=params))
    with pytest.raises(type(error), match=r"^CUDA error: "):
        step_until(peer.step, lambda: len(answers) == 2, 30.0, lambda: f"{answers}")
    assert len(answers) == 1
