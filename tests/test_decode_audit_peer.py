"""Decode peer audit fixes: a raising local prompt forward of a fake-host request fails that
request only; a relayed peer abort on a decode mesh keeps its ``peer``; a request that waits
out its deadline in PREALLOC fails as one that never got decode pages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest

from kv.fake import FakeDecodeManager, FakeKVReceiver
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.refusal import peer_refusal
from lifecycle import DecodeState, FailureReason, SamplingParams
from scheduler.decode import DecodeConfig, DecodePeer
from scheduler.decode.mesh import MeshDecodePeer
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake
from scheduler.dist.ranks import SingleRank
from scheduler.messages import FAKE_BOOTSTRAP_HOST, DecodeResponse, NewRequest
from scheduler.runner import ForwardBatch
from scheduler.stepping import step_until
from scheduler.testing.fakes import PageEchoRunner
from tests.transfer_harness import make_pool

S = DecodeState
PROMPT = (1, 2, 3, 4, 5, 6)


class PromptRaising(PageEchoRunner):
    """Raises ``error`` from the next ``prompts`` prompt forwards (more than one token); decode
    steps run as usual."""

    def __init__(self, error: BaseException, prompts: int = 1) -> None:
        super().__init__(make_pool(num_pages=32, page_size=4))
        self.error = error
        self.prompts = prompts

    def forward(self, batch: ForwardBatch) -> list[int]:
        if self.prompts and len(batch.items[0].input_ids) > 1:
            self.prompts -= 1
            raise self.error
        return super().forward(batch)


def _fake_peer(runner: PageEchoRunner, answers: dict[str, DecodeResponse],
               make: Callable[..., DecodePeer] = DecodePeer,
               **options: object) -> tuple[DecodePeer, LocalPrefillFake]:
    meta = MetadataBuffers(8)
    fake = LocalPrefillFake(runner, meta)
    peer = make(runner=runner, kv=DecodeKVRouter(fake=fake), metadata=meta,
                slots=SlotAllocator(8), on_response=lambda r: answers.__setitem__(r.rid, r),
                config=DecodeConfig(check_invariants=True), **options)
    return peer, fake


def _submit_fake(peer: DecodePeer, fake: LocalPrefillFake, rid: str, room: int,
                 max_new_tokens: int = 4) -> None:
    fake.expect(room, rid, PROMPT)
    peer.submit(NewRequest(rid, list(PROMPT), bootstrap_host=FAKE_BOOTSTRAP_HOST,
                           bootstrap_port=0, bootstrap_room=room,
                           sampling=SamplingParams(max_new_tokens, (), True)))


def test_a_raising_local_prompt_forward_fails_its_request_and_the_loop_goes_on() -> None:
    runner = PromptRaising(RuntimeError("simulated out of memory"))
    answers: dict[str, DecodeResponse] = {}
    peer, fake = _fake_peer(runner, answers)
    _submit_fake(peer, fake, "probe", 5)
    step_until(peer.step, lambda: "probe" in answers, 10.0,
               lambda: f"probe unanswered: {peer.lifecycle.get('probe')!r}")
    r = answers["probe"]
    assert (r.state, r.reason) == (S.FAILED, FailureReason.INTERNAL)
    assert r.detail == ("the local prompt forward failed: "
                        "RuntimeError('simulated out of memory')")
    step_until(peer.step, peer.idle, 10.0, lambda: "the peer kept pages or requests")
    assert runner.pool.allocator.in_use() == 0 and peer._pages.reserved() == 0
    peer.check_invariants()
    # The loop went on: the next fake request decodes to the end on the same peer.
    _submit_fake(peer, fake, "next", 6)
    step_until(peer.step, lambda: "next" in answers, 10.0)
    assert answers["next"].state is S.DONE and len(answers["next"].output_ids) == 4
    assert runner.violations == []


def test_a_device_error_in_the_local_prompt_forward_leaves_step() -> None:
    runner = PromptRaising(RuntimeError("CUDA error: an illegal memory access was encountered"))
    answers: dict[str, DecodeResponse] = {}
    peer, fake = _fake_peer(runner, answers)
    _submit_fake(peer, fake, "probe", 5)
    with pytest.raises(RuntimeError, match=r"^CUDA error: "):
        step_until(peer.step, lambda: "probe" in answers, 10.0)
    assert answers == {}



class RaisingSend(FakeKVReceiver):
    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        raise ValueError("destination rejected by the backend")


class RaisingSendManager(FakeDecodeManager):
    def __init__(self) -> None:
        super().__init__()
        self.refused: list[tuple[str, int, str]] = []

    def create_receiver(self, bootstrap_addr: str, room: int) -> RaisingSend:
        return RaisingSend(self, bootstrap_addr, room)

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        self.refused.append((bootstrap_addr, room, reason))


def test_a_raising_destination_send_fails_its_request_and_is_refused_to_prefill() -> None:
    runner = PromptRaising(RuntimeError("unused"), prompts=0)
    meta = MetadataBuffers(8)
    manager = RaisingSendManager()
    answers: dict[str, DecodeResponse] = {}
    peer = DecodePeer(runner=runner, metadata=meta, slots=SlotAllocator(8),
                      kv=DecodeKVRouter(fake=LocalPrefillFake(runner, meta), default=manager),
                      on_response=lambda r: answers.__setitem__(r.rid, r),
                      config=DecodeConfig(check_invariants=True))
    peer.submit(NewRequest("a", PROMPT, bootstrap_host="127.0.0.1", bootstrap_port=9,
                           bootstrap_room=7))
    step_until(peer.step, lambda: "a" in answers and peer.idle(), 10.0,
               lambda: f"answers: {answers}")
    r = answers["a"]
    detail = ("sending the destination to prefill failed: "
              "ValueError('destination rejected by the backend')")
    assert (r.state, r.reason, r.detail) == (S.FAILED, FailureReason.INTERNAL, detail)
    assert manager.refused == [("127.0.0.1:9", 7, detail)]
    assert runner.pool.allocator.in_use() == 0

# -- a decode mesh relays a peer abort with its peer -------------------------------------------


def _single_rank_control() -> SimpleNamespace:
    """A decode mesh of one rank: the relay, the clock and the receivers' agreement are this
    rank's own (what the collectives give on a group of one)."""
    return SimpleNamespace(relay=SimpleNamespace(exchange=lambda items: items),
                           share_clock=lambda now: now, ranks=SingleRank(), first=True)


def _mesh_peer(runner: PageEchoRunner, answers: dict[str, DecodeResponse]
               ) -> tuple[DecodePeer, LocalPrefillFake]:
    def make(**options: object) -> DecodePeer:
        return MeshDecodePeer(_single_rank_control(), **options)  # type: ignore[arg-type]
    return _fake_peer(runner, answers, make)


LATE = peer_refusal("transfer_timeout", 500, "the prefill half timed out late")


@pytest.mark.parametrize("mesh", [False, True], ids=["plain", "mesh"])
def test_a_peer_abort_of_a_decoding_request_is_ignored(mesh: bool) -> None:
    runner = PromptRaising(RuntimeError("unused"), prompts=0)
    answers: dict[str, DecodeResponse] = {}
    peer, fake = (_mesh_peer if mesh else _fake_peer)(runner, answers)
    _submit_fake(peer, fake, "a", 7, max_new_tokens=8)

    def decoding() -> bool:
        req = peer.lifecycle.get("a")
        return req is not None and req.state is S.DECODING
    step_until(peer.step, decoding, 10.0)
    peer.abort("a", peer=LATE)
    step_until(peer.step, lambda: "a" in answers, 10.0)
    r = answers["a"]
    assert (r.state, r.reason, len(r.output_ids)) == (S.DONE, None, 8)


@pytest.mark.parametrize("mesh", [False, True], ids=["plain", "mesh"])
def test_a_peer_abort_before_decoding_fails_bootstrap_failed(mesh: bool) -> None:
    runner = PromptRaising(RuntimeError("unused"), prompts=0)
    answers: dict[str, DecodeResponse] = {}
    peer, fake = (_mesh_peer if mesh else _fake_peer)(runner, answers)
    _submit_fake(peer, fake, "a", 7)
    peer.abort("a", peer=LATE)  # taken in the same pass, right after its admission
    step_until(peer.step, lambda: "a" in answers, 10.0)
    r = answers["a"]
    assert (r.state, r.reason) == (S.FAILED, FailureReason.BOOTSTRAP_FAILED)
    assert "peer refused: transfer_timeout (500)" in r.detail


# -- the waiting deadline of a request queued for decode pages -----------------------------------


def test_a_request_that_waits_out_its_deadline_in_prealloc_says_decode_had_no_pages() -> None:
    runner = PromptRaising(RuntimeError("unused"), prompts=0)
    meta = MetadataBuffers(8)
    fake = LocalPrefillFake(runner, meta)
    answers: dict[str, DecodeResponse] = {}
    now = [0.0]
    peer = DecodePeer(runner=runner, kv=DecodeKVRouter(fake=fake), metadata=meta,
                      slots=SlotAllocator(8), clock=lambda: now[0],
                      on_response=lambda r: answers.__setitem__(r.rid, r),
                      config=DecodeConfig(max_running_requests=1, waiting_timeout=30.0,
                                          check_invariants=True))
    # "long" holds the one running place while it decodes; the clock stands still meanwhile.
    _submit_fake(peer, fake, "long", 5, max_new_tokens=20)
    _submit_fake(peer, fake, "queued", 6)

    def queued_in_prealloc() -> bool:
        long, queued = peer.lifecycle.get("long"), peer.lifecycle.get("queued")
        return (long is not None and long.state is S.DECODING
                and queued is not None and queued.state is S.PREALLOC)
    step_until(peer.step, queued_in_prealloc, 10.0)
    now[0] += 31.0
    step_until(peer.step, lambda: "queued" in answers, 10.0)
    r = answers["queued"]
    assert (r.state, r.reason) == (S.FAILED, FailureReason.BOOTSTRAP_TIMEOUT)
    assert r.detail == ("no decode pages for it within 30 s (the decode side's pages, metadata "
                        "slots or max_running_requests were held by other requests): its "
                        "destination was never sent to prefill")
    assert "long" not in answers  # its deadline passed too, but it is decoding


def test_a_request_that_waits_out_its_deadline_receiving_says_no_kv_from_prefill() -> None:
    answers: dict[str, DecodeResponse] = {}
    runner = PromptRaising(RuntimeError("unused"), prompts=0)
    meta = MetadataBuffers(8)
    fake = LocalPrefillFake(runner, meta)
    fake.sources = 10 ** 6  # the transfer never completes
    now = [0.0]
    peer = DecodePeer(runner=runner, kv=DecodeKVRouter(fake=fake), metadata=meta,
                      slots=SlotAllocator(8), clock=lambda: now[0],
                      on_response=lambda r: answers.__setitem__(r.rid, r),
                      config=DecodeConfig(waiting_timeout=30.0, check_invariants=True))
    _submit_fake(peer, fake, "a", 5)

    def receiving() -> bool:
        req = peer.lifecycle.get("a")
        return req is not None and req.state is S.RECEIVING
    step_until(peer.step, receiving, 10.0)
    now[0] += 31.0
    step_until(peer.step, lambda: "a" in answers, 10.0)
    r = answers["a"]
    assert (r.state, r.reason, r.detail) == (
        S.FAILED, FailureReason.TRANSFER_TIMEOUT, "no KV from prefill within 30 s")
