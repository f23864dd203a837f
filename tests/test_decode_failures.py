"""What a decode request's failure is called when its receiver fails on its own: before the
destination went out ``bootstrap_*``, after it ``transfer_*``; ``*_timeout`` where the
receiver's error says it timed out (a backend of one's own may), as on the prefill side."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kv.fake import FakeDecodeManager, FakeKVReceiver
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.transfer import KVPoll, TransferError
from lifecycle import FailureReason
from scheduler.decode import DecodePeer
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake
from scheduler.messages import DecodeResponse, NewRequest
from scheduler.stepping import step_until
from scheduler.testing.fakes import PageEchoRunner
from tests.transfer_harness import make_pool


class Stalling(FakeKVReceiver):
    """Stays in ``stop_at`` (BOOTSTRAPPING or TRANSFERRING) until :meth:`fail`."""

    def __init__(self, manager: FakeDecodeManager, addr: str, room: int,
                 stop_at: KVPoll) -> None:
        super().__init__(manager, addr, room)
        self.stop_at = stop_at
        self.timeout = False

    def init(self) -> None:
        if self.stop_at is not KVPoll.BOOTSTRAPPING:
            super().init()

    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        self._set(KVPoll.TRANSFERRING)

    def poll(self) -> KVPoll:
        return self._status

    def fail(self, reason: str, *, timeout: bool) -> None:
        self.timeout = timeout
        self._set(KVPoll.FAILED, reason)

    def failure_exception(self) -> TransferError:
        return TransferError.reported(self.room, self._status, self._reason,
                                      self.bootstrap_addr, timeout=self.timeout)


@pytest.mark.parametrize(("stop_at", "timeout", "expected"), [
    (KVPoll.BOOTSTRAPPING, False, FailureReason.BOOTSTRAP_FAILED),
    (KVPoll.BOOTSTRAPPING, True, FailureReason.BOOTSTRAP_TIMEOUT),
    (KVPoll.TRANSFERRING, False, FailureReason.TRANSFER_FAILED),
    (KVPoll.TRANSFERRING, True, FailureReason.TRANSFER_TIMEOUT),
], ids=lambda v: v.name.lower() if isinstance(v, KVPoll) else str(v))
def test_a_receiver_failure_is_named_by_the_stage_and_its_timeout_flag(
    stop_at: KVPoll, timeout: bool, expected: FailureReason,
) -> None:
    receivers: list[Stalling] = []

    class Manager(FakeDecodeManager):
        def create_receiver(self, bootstrap_addr: str, room: int) -> Stalling:
            receivers.append(Stalling(self, bootstrap_addr, room, stop_at))
            return receivers[-1]

    pool, metadata = make_pool(), MetadataBuffers(4)
    router = DecodeKVRouter(fake=LocalPrefillFake(PageEchoRunner(pool), metadata),
                            default=Manager())
    answers: list[DecodeResponse] = []
    peer = DecodePeer(runner=PageEchoRunner(pool), kv=router, metadata=metadata,
                      slots=SlotAllocator(4), on_response=answers.append)
    peer.submit(NewRequest("a", (1, 2, 3), bootstrap_host="127.0.0.1", bootstrap_port=9,
                           bootstrap_room=7))
    step_until(peer.step, lambda: bool(receivers) and receivers[0].poll() is stop_at, 10.0,
               lambda: f"receivers: {receivers}")

    receivers[0].fail("no word from the prefill within 5 s", timeout=timeout)
    step_until(peer.step, lambda: bool(answers) and peer.idle(), 10.0,
               lambda: f"answers: {answers}")
    assert answers[0].reason is expected, answers
    assert "no word from the prefill within 5 s" in answers[0].detail
    peer.check_invariants()
    assert pool.allocator.available() == pool.num_pages
    router.close()
