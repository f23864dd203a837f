"""Every ``Abort`` gets an answer: a room's ``Status`` lost on the way (ZeroMQ PUSH loses the
messages queued on a connection torn down, e.g. by a NAT or conntrack idle timeout, while the
prefill's health checks pass) is sent again when decode's ``Abort`` of the room comes, so decode
frees the room's pages instead of holding them for as long as the prefill lives.

A real prefill manager and a real decode manager move the KV over Mooncake on loopback; the
loss is made at the boundary: the prefill rank's status socket to the decode session drops the
first ``Status`` of the room, as a torn-down connection would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kv import wire
from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import MooncakeConfig
from kv.transfer import KVPoll
from tests.transfer_harness import drive, eventually, make_pool

pytestmark = pytest.mark.mooncake

_TERMINAL = {KVPoll.SUCCESS, KVPoll.FAILED}


class LossySocket:
    """A status socket that loses the first ``Status`` of ``room`` (the rest go through)."""

    def __init__(self, sock: zmq.Socket[Any], room: int) -> None:
        self._sock = sock
        self._room = room
        self.lost = threading.Event()

    def send(self, data: bytes, flags: int = 0) -> None:
        msg = wire.decode(data, None)
        if isinstance(msg, wire.Status) and msg.room == self._room and not self.lost.is_set():
            self.lost.set()
            return
        self._sock.send(data, flags)

    def close(self, linger: int | None = None) -> None:
        self._sock.close(linger)


@pytest.fixture
def pair() -> Iterator[tuple[BootstrapServer, MooncakeKVManager, MooncakeDecodeManager,
                             MetadataBuffers]]:
    server = BootstrapServer()
    metadata = MetadataBuffers(8)
    prefill = MooncakeKVManager(make_pool(), metadata)
    prefill.register_to_bootstrap(server.address)
    # No health check while the test runs: the prefill answers throughout.
    decode = MooncakeDecodeManager(make_pool(), MetadataBuffers(8), server.address,
                                   config=MooncakeConfig(heartbeat_interval_s=3600))
    try:
        eventually(lambda: prefill.decode_sessions() == [decode.session], "registered")
        yield server, prefill, decode, metadata
    finally:
        decode.close()
        prefill.close()
        server.close()


def _lose_first_status(prefill: MooncakeKVManager, session: str, room: int) -> LossySocket:
    with prefill._push_lock:
        lossy = LossySocket(prefill._push[session], room)
        prefill._push[session] = lossy  # type: ignore[assignment]
    return lossy


@pytest.mark.parametrize("cleared", [False, True])
def test_a_lost_status_is_sent_again_when_decode_aborts_and_the_pages_go_back(
    pair: tuple[BootstrapServer, MooncakeKVManager, MooncakeDecodeManager, MetadataBuffers],
    cleared: bool,
) -> None:
    server, prefill, decode, metadata = pair
    lossy = _lose_first_status(prefill, decode.session, 9)
    receiver = decode.create_receiver(server.address, 9)
    receiver.init()
    receiver.send_metadata([0, 1], 0)
    sender = prefill.create_sender(server.address, 9)
    assert drive(prefill, sender, {KVPoll.WAITING_FOR_INPUT})[-1] == KVPoll.WAITING_FOR_INPUT
    pages = prefill.pool.allocator.alloc(2)
    assert pages is not None
    sender.init(2, 0)
    metadata.write(0, first_token=1, cached_tokens=0, logprob=None, room=9)
    sender.send(pages, last=True)
    assert drive(prefill, sender, _TERMINAL)[-1] == KVPoll.SUCCESS
    assert lossy.lost.wait(10), "the status was not sent"
    eventually(sender.quiescent, "the sender quiescent")
    sender.clear()
    # Decode never heard: the room waits, its pages held.
    assert receiver.poll() == KVPoll.TRANSFERRING and not receiver.quiescent()
    receiver.abort()  # decode's waiting timeout
    assert receiver.poll() == KVPoll.FAILED
    if cleared:
        receiver.clear()  # held, counted, until a status comes
        assert decode.live_rooms() == 1
        eventually(lambda: decode.live_rooms() == 0, "the pages given back")
    else:
        eventually(receiver.quiescent, "the status sent again")
        receiver.clear()
        assert decode.live_rooms() == 0
    assert prefill.dropped_messages.total == 0 and decode.dropped_messages.total == 0
