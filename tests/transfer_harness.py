"""Backend harnesses: one way to build and drive each transfer backend for the contract suite.

A :class:`BackendHarness` makes a :class:`HarnessSession`: a prefill :class:`KVManager` with its
pool and metadata buffers, plus the means to play the decode side of a room (handshake with
given destination pages and slot, read back what landed, send a late message). The contract
suite (tests/test_transfer_contract.py) runs the same tests over every harness in its
``HARNESSES`` list, and over a backend's own harness named with ``--transfer-harness
MODULE:NAME`` (:func:`load_harnesses`). A harness whose sessions play the decode side with a
real :class:`DecodeKVManager` (``plays_decode``; :class:`InProcessDecode` does it) also runs the
tests of a receiver.
"""

from __future__ import annotations

import importlib
import queue
import time
import weakref
from collections.abc import Callable, Collection
from typing import Protocol

import pytest
import torch

from kv.fake import FakeKVManager, FaultPlan
from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers, MetadataRow, SlotAllocator
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from kv.transfer import DecodeKVManager, KVManager, KVPoll, KVReceiver, KVSender

GEOMETRY = {"num_layers": 2, "page_size": 4, "kv_heads": 2, "head_dim": 8}
NUM_PAGES = 32
NUM_SLOTS = 8
TIMEOUT_S = 10.0


def make_pool(num_pages: int = NUM_PAGES, **overrides: object) -> KVPool:
    kwargs: dict[str, object] = {**GEOMETRY, "num_pages": num_pages, **overrides}
    return KVPool(**kwargs)  # type: ignore[arg-type]


class HarnessSession(Protocol):
    manager: KVManager
    bootstrap_addr: str
    prefill_pool: KVPool
    prefill_metadata: MetadataBuffers

    def connect_decode(self, room: int, num_pages: int) -> None:
        """Play the decode side's handshake for ``room``: allocate ``num_pages`` destination
        pages and a metadata slot, and send them to the prefill side."""

    def late_message(self, room: int) -> None:
        """Deliver, from the decode side, a stale message (an abort) for ``room``'s previous
        receivers: it must not affect a sender created after the room was cleared."""

    def decode_kv(self, room: int) -> torch.Tensor:
        """``[layers, 2, num_pages, page_size, kv_heads, head_dim]``: what landed in ``room``'s
        destination pages, in the order they were given, whatever the pools' layout (backends
        that move data only)."""

    def decode_row(self, room: int) -> MetadataRow | None:
        """What landed in ``room``'s decode metadata slot (backends that move data only)."""

    def close(self) -> None: ...


class PeerSession(HarnessSession, Protocol):
    """A session whose decode side is a real :class:`DecodeKVManager`."""

    decode: DecodeKVManager
    receivers: dict[int, list[KVReceiver]]

    def wait_decode(self, room: int) -> KVReceiver:
        """Create and initialise ``room``'s receiver as the decode peer does when it admits a
        request, and wait until ``init()`` resolved the prefill (it may do so later), without
        sending a destination: the request waits for pages."""


class BackendHarness(Protocol):
    name: str
    moves_data: bool
    plays_decode: bool  # its sessions are PeerSessions
    marks: tuple[pytest.MarkDecorator, ...]
    layout: KVLayout

    def make(self) -> HarnessSession: ...


def load_harnesses(spec: str) -> list[BackendHarness]:
    """The harnesses ``MODULE:NAME`` names: a :class:`BackendHarness`, or a list of them (one
    per pool layout, say)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise pytest.UsageError(f"--transfer-harness: expected MODULE:NAME, got {spec!r}")
    found = getattr(importlib.import_module(module), name)
    harnesses = list(found) if isinstance(found, (list, tuple)) else [found]
    for harness in harnesses:
        missing = [a for a in ("name", "moves_data", "plays_decode", "marks", "layout", "make")
                   if not hasattr(harness, a)]
        if missing:
            raise pytest.UsageError(f"--transfer-harness {spec}: {harness!r} has no "
                                    f"{', '.join(missing)} (see tests/transfer_harness.py)")
    return harnesses


# -- waiting, driven by the readiness queue ------------------------------------------------


# Rooms taken off a manager's ready queue while waiting for another room: a later drive()
# for them must still see that they were pushed.
_stashed: weakref.WeakKeyDictionary[object, set[int]] = weakref.WeakKeyDictionary()


def _wait_pushed(manager: KVManager, room: int, deadline: float) -> bool:
    stash = _stashed.setdefault(manager, set())
    while room not in stash:
        try:
            stash.add(manager.ready.get(timeout=max(deadline - time.monotonic(), 0.0)))
        except queue.Empty:
            return False
    stash.discard(room)
    return True


def drive(
    manager: KVManager, sender: KVSender, until: Collection[KVPoll], timeout: float = TIMEOUT_S
) -> list[KVPoll]:
    """Poll ``sender`` only when its room comes off ``manager.ready`` (after one initial poll)
    until it reports a state in ``until``; returns the distinct states seen, in order.

    Fails when the room is not pushed in time: readiness must be pushed, not polled for."""
    seen: list[KVPoll] = []
    deadline = time.monotonic() + timeout
    while True:
        state = sender.poll()
        if not seen or seen[-1] != state:
            seen.append(state)
        if state in until:
            return seen
        if not _wait_pushed(manager, sender.room, deadline):
            raise AssertionError(
                f"room {sender.room} stuck in {state.name}: not pushed onto ready "
                f"within {timeout}s (seen {[s.name for s in seen]})"
            )


def eventually(predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    """Wait until ``predicate()`` holds, checking every millisecond; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)


# -- fake ---------------------------------------------------------------------------------


class _FakeSession:
    bootstrap_addr = "2.2.2.2:8998"

    def __init__(self) -> None:
        # One poll of delay, so the first poll reports BOOTSTRAPPING as a real backend does.
        self.manager = FakeKVManager(FaultPlan(handshake_delay_polls=1))
        self.prefill_pool = make_pool()
        self.prefill_metadata = MetadataBuffers(NUM_SLOTS)

    def connect_decode(self, room: int, num_pages: int) -> None:
        """The fake handshake completes by polling; there is no decode side to play."""

    def late_message(self, room: int) -> None:
        """The fake backend has no peer, so no message can arrive late."""

    def decode_kv(self, room: int) -> torch.Tensor:
        raise AssertionError("the fake backend moves no data")

    def decode_row(self, room: int) -> MetadataRow | None:
        raise AssertionError("the fake backend moves no data")

    def close(self) -> None:
        self.manager.close()


class FakeHarness:
    name = "fake"
    moves_data = False
    plays_decode = False
    marks: tuple[pytest.MarkDecorator, ...] = ()
    layout = KVLayout.LAYER_MAJOR

    def make(self) -> HarnessSession:
        return _FakeSession()


# -- local --------------------------------------------------------------------------------


class InProcessDecode:
    """The decode side played in-process by a real decode manager: the handshake of a room
    (:meth:`connect_decode`) records its receivers and its destination pages and slot, from
    which what landed is read back."""

    bootstrap_addr: str
    decode: DecodeKVManager
    decode_pool: KVPool
    decode_metadata: MetadataBuffers
    decode_slots: SlotAllocator
    receivers: dict[int, list[KVReceiver]]
    destinations: dict[int, tuple[list[int], int]]

    def wait_decode(self, room: int) -> KVReceiver:
        receiver = self.decode.create_receiver(self.bootstrap_addr, room)
        receiver.init()
        eventually(lambda: receiver.poll() != KVPoll.BOOTSTRAPPING,
                   f"room {room}'s receiver to resolve the prefill")
        self.receivers.setdefault(room, []).append(receiver)
        return receiver

    def connect_decode(self, room: int, num_pages: int) -> None:
        pages = self.decode_pool.allocator.alloc(num_pages)
        slot = self.decode_slots.alloc()
        assert pages is not None and slot is not None, "decode side of the harness is full"
        # Reversed, so destination runs break where source runs do not.
        pages.reverse()
        self.wait_decode(room).send_metadata(pages, slot)
        self.destinations[room] = (pages, slot)

    def decode_kv(self, room: int) -> torch.Tensor:
        pages, _ = self.destinations[room]
        return self.decode_pool.by_layer()[:, :, pages].clone()

    def decode_row(self, room: int) -> MetadataRow | None:
        _, slot = self.destinations[room]
        return self.decode_metadata.read(slot, expected_room=room)


class _LocalSession(InProcessDecode):
    bootstrap_addr = "local:contract"

    def __init__(self, layout: KVLayout) -> None:
        self.hub = LocalTransferHub()
        self.prefill_pool = make_pool(layout=layout)
        self.prefill_metadata = MetadataBuffers(NUM_SLOTS)
        self.manager = LocalKVManager(
            self.prefill_pool,
            self.prefill_metadata,
            hub=self.hub,
            bootstrap_addr=self.bootstrap_addr,
        )
        self.decode_pool = make_pool(2 * NUM_PAGES, layout=layout)
        self.decode_metadata = MetadataBuffers(2 * NUM_SLOTS)
        self.decode_slots = SlotAllocator(2 * NUM_SLOTS)
        self.decode = LocalDecodeManager(self.decode_pool, self.decode_metadata, hub=self.hub)
        self.receivers = {}
        self.destinations = {}

    def late_message(self, room: int) -> None:
        for receiver in self.receivers.pop(room, []):
            receiver.abort()

    def close(self) -> None:
        self.manager.close()
        self.decode.close()


class LocalHarness:
    moves_data = True
    plays_decode = True
    marks: tuple[pytest.MarkDecorator, ...] = ()

    def __init__(self, layout: KVLayout = KVLayout.LAYER_MAJOR) -> None:
        self.layout = layout
        self.name = layout_name("local", layout)

    def make(self) -> HarnessSession:
        return _LocalSession(self.layout)


def layout_name(backend: str, layout: KVLayout) -> str:
    """A harness's test id: the backend's name, and the pool layout unless it is layer-major."""
    return backend if layout is KVLayout.LAYER_MAJOR else f"{backend}-{layout.value}"
