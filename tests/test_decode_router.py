"""The decode router's managers, one per prefill server: calls to connect an address share one
look-up; the Mooncake manager of a prefill server that is gone is retired (closed once its
prefill has counted as lost long enough and none of its rooms is open) and replaced by a new one
when a request names that address again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kv.bootstrap import BootstrapServer
from kv.fake import FakeDecodeManager
from kv.listeners import listening
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import MooncakeConfig, MooncakeError
from kv.transfer import KVPoll, TransferUsageError
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake, PeerUnreachable
from scheduler.testing.fakes import PageEchoRunner
from tests.transfer_harness import drive, eventually, make_pool

ADDR = "127.0.0.1:9"

# The prefill counts as gone after two failed health checks 50 ms apart.
FAST_HEARTBEAT = MooncakeConfig(heartbeat_interval_s=0.05, heartbeat_max_failures=2)


class Prefill:
    """A prefill server (bootstrap endpoint and one rank) that can stop and start again on the
    same port."""

    def __init__(self) -> None:
        self.server = BootstrapServer()
        self.port = int(self.server.address.rpartition(":")[2])
        self.manager = self._rank()

    @property
    def address(self) -> str:
        return self.server.address

    def _rank(self) -> MooncakeKVManager:
        manager = MooncakeKVManager(make_pool(), MetadataBuffers(8))
        manager.register_to_bootstrap(self.server.address)
        return manager

    def stop(self) -> None:
        self.manager.close()
        self.server.close()

    def restart(self) -> None:
        self.server = BootstrapServer(port=self.port)
        self.manager = self._rank()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.stop()


def make_router(managers: list[MooncakeDecodeManager], after: float) -> DecodeKVRouter:
    pool, metadata = make_pool(), MetadataBuffers(8)

    def factory(addr: str) -> MooncakeDecodeManager:
        managers.append(MooncakeDecodeManager(pool, metadata, addr, config=FAST_HEARTBEAT))
        return managers[-1]

    return DecodeKVRouter(fake=local_fake(), factory=factory, retire_lost_after_s=after)


def engine_port(manager: MooncakeDecodeManager) -> int:
    return int(manager.session.rpartition(":")[2])


def local_fake() -> LocalPrefillFake:
    return LocalPrefillFake(PageEchoRunner(make_pool()), MetadataBuffers(8))


def connector(router: DecodeKVRouter) -> tuple[Callable[[], None], list[str]]:
    """A call connecting ``router`` to ADDR, and the outcomes of its calls: "connected", or
    why not."""
    outcomes: list[str] = []

    def connect() -> None:
        try:
            router.connect(ADDR)
            outcomes.append("connected")
        except PeerUnreachable as exc:
            outcomes.append(str(exc))

    return connect, outcomes


@pytest.mark.parametrize("reachable", [False, True])
def test_calls_for_an_address_being_looked_up_share_that_look_up(reachable: bool) -> None:
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def factory(addr: str) -> FakeDecodeManager:
        calls.append(addr)
        started.set()
        assert release.wait(10)
        if not reachable:
            raise MooncakeError("prefill bootstrap lookup failed: nothing answers")
        return FakeDecodeManager()

    router = DecodeKVRouter(fake=local_fake(), factory=factory)
    connect, outcomes = connector(router)

    threads = [threading.Thread(target=connect) for _ in range(3)]
    try:
        threads[0].start()
        assert started.wait(10)
        for t in threads[1:]:
            t.start()
        eventually(lambda: router.connecting() == {ADDR: 2}, "two calls waiting on the look-up")
        release.set()
        for t in threads:
            t.join(10)
        assert calls == [ADDR]  # one look-up for the three calls
        assert router.connecting() == {}
        if reachable:
            assert outcomes == ["connected"] * 3 and router.peers() == [ADDR]
        else:
            assert len(outcomes) == 3 and len(set(outcomes)) == 1, outcomes
            assert outcomes[0] == f"prefill bootstrap {ADDR}: prefill bootstrap lookup failed: " \
                                  "nothing answers"
            assert router.peers() == []
            with pytest.raises(PeerUnreachable):
                router.connect(ADDR)  # a later call looks again
            assert calls == [ADDR, ADDR]
    finally:
        release.set()
        router.close()


def test_a_manager_made_after_the_router_closed_is_closed_and_its_call_refused() -> None:
    started, release = threading.Event(), threading.Event()
    made: list[Closing] = []

    def factory(addr: str) -> FakeDecodeManager:
        started.set()
        assert release.wait(10)
        made.append(Closing())
        return made[-1]

    router = DecodeKVRouter(fake=local_fake(), factory=factory)
    connect, outcomes = connector(router)

    thread = threading.Thread(target=connect)
    thread.start()
    try:
        assert started.wait(10)
        router.close()
        assert router.closing.is_set()
    finally:
        release.set()
        thread.join(10)
    assert outcomes == [f"prefill bootstrap {ADDR}: the decode side is closing"]
    assert made[0].closed and router.peers() == []


class Closing(FakeDecodeManager):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.mooncake
def test_a_lost_prefill_is_retired_after_its_rooms_and_a_returning_one_gets_a_new_manager(
    prefill: Prefill,
) -> None:
    managers: list[MooncakeDecodeManager] = []
    router = make_router(managers, after=3600.0)  # retired here only when the test says "now"
    addr = prefill.address
    try:
        router.connect(addr)
        (first,) = managers
        assert engine_port(first) in {s.port for s in listening()}
        held = router.create_receiver(addr, 1)
        held.init()
        prefill.stop()
        eventually(lambda: first.lost_since is not None, "the prefill counts as gone")
        assert held.poll() == KVPoll.FAILED
        later = time.monotonic() + 7200
        assert router.retire_lost(now=later) == []  # room 1 is still open
        assert router.retire_lost() == []  # not lost for an hour yet
        held.clear()
        assert router.retire_lost(now=later) == [addr]
        assert router.peers() == [] and first not in router.managers()
        port = engine_port(first)
        eventually(lambda: port not in {s.port for s in listening()}, "its engine closed")
        assert not [t for t in threading.enumerate() if t.name == "mooncake-heartbeat"]
        with pytest.raises(TransferUsageError, match="retired after it was lost"):
            router.create_receiver(addr, 2)

        prefill.restart()
        router.connect(addr)
        second = managers[-1]
        assert len(managers) == 2 and router.peers() == [addr] and second.lost is None
        receiver = router.create_receiver(addr, 3)
        receiver.init()
        receiver.send_metadata([4, 5], 1)
        sender = prefill.manager.create_sender(addr, 3)
        drive(prefill.manager, sender, {KVPoll.WAITING_FOR_INPUT})
        sender.init(2, 0)
        prefill.manager.metadata.write(0, first_token=9, cached_tokens=0, logprob=None, room=3)
        sender.send([6, 7], last=True)
        assert drive(prefill.manager, sender, {KVPoll.SUCCESS, KVPoll.FAILED})[-1] == KVPoll.SUCCESS
        eventually(lambda: receiver.poll() == KVPoll.SUCCESS, "room 3 landed through the new one")
        receiver.clear()
        assert router.retire_lost(now=later) == []  # it answers: kept
    finally:
        router.close()


@pytest.mark.mooncake
def test_the_router_retires_on_its_own_thread(prefill: Prefill) -> None:
    managers: list[MooncakeDecodeManager] = []
    router = make_router(managers, after=0.1)
    try:
        router.connect(prefill.address)
        prefill.stop()
        port = engine_port(managers[0])
        eventually(lambda: router.peers() == [], "the lost prefill's manager retired")
        eventually(lambda: port not in {s.port for s in listening()}, "its engine closed")
        prefill.restart()
    finally:
        router.close()
    assert not [t for t in threading.enumerate() if t.name == "decode-retire"]


def test_retirement_is_off_without_a_setting_or_a_factory() -> None:
    fake = local_fake()
    with pytest.raises(ValueError, match="retire_lost_after_s must be > 0"):
        DecodeKVRouter(fake=fake, factory=lambda addr: fake, retire_lost_after_s=0)
    plain = DecodeKVRouter(fake=fake, retire_lost_after_s=1.0)  # no factory: nothing to retire
    try:
        assert plain.retire_lost(now=time.monotonic() + 7200) == []
        assert not [t for t in threading.enumerate() if t.name == "decode-retire"]
    finally:
        plain.close()
    assert MooncakeConfig(retire_lost_after_s=None).retire_lost_after_s is None
