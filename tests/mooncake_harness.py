"""Mooncake test fixtures: a decode peer in another process, and the contract harness.

:class:`DecodePeer` runs ``tests/mooncake_peer.py`` and turns its JSON-line events into a queue
that tests wait on with timeouts (never sleeps).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kv import wire
from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.pool_layout import KVLayout
from tests.transfer_harness import (
    NUM_PAGES,
    NUM_SLOTS,
    HarnessSession,
    InProcessDecode,
    layout_name,
    make_pool,
)

_PEER = Path(__file__).with_name("mooncake_peer.py")
_ROOT = _PEER.parent.parent


class DecodePeer:
    """A decode process with its own Mooncake engine, registered with ``bootstrap_addr``."""

    def __init__(self, bootstrap_addr: str, *, timeout_s: float = 30.0, **geometry: Any) -> None:
        argv = [sys.executable, str(_PEER), "--bootstrap", bootstrap_addr]
        for key, value in geometry.items():
            if value is not None:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        env = dict(os.environ, PYTHONPATH=str(_ROOT))
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, cwd=_ROOT,
        )
        self._events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self._info: dict[str, Any] | None = None
        self._timeout_s = timeout_s

    @property
    def info(self) -> dict[str, Any]:
        """The ``ready`` event (session, pool pointer); waits for it the first time.

        Starting several peers before reading any ``info`` lets them start in parallel.
        """
        if self._info is None:
            self._info = self.wait_event(lambda e: e["event"] == "ready", self._timeout_s)
        return self._info

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._events.put(json.loads(line))
        self._events.put({"event": "exited"})

    def command(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait_event(self, match: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0
                   ) -> dict[str, Any]:
        """The first event (seen before or arriving within ``timeout_s``) that ``match``es."""
        for i, event in enumerate(self._seen):
            if match(event):
                return self._seen.pop(i)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"decode peer: no matching event in {timeout_s}s")
            try:
                event = self._events.get(timeout=left)
            except queue.Empty:
                continue
            if event["event"] == "exited" and not match(event):
                raise RuntimeError(f"decode peer exited (rc={self.proc.wait()})")
            if match(event):
                return event
            self._seen.append(event)

    def recv(self, room: int, num_pages: int) -> tuple[list[int], int]:
        """Post a destination for ``room``; its decode pages and slot."""
        assert self.info
        self.command(cmd="recv", room=room, num_pages=num_pages)
        event = self.wait_event(
            lambda e: e.get("room") == room and e["event"] in ("posted", "full")
        )
        if event["event"] == "full":
            raise RuntimeError(f"decode peer has no room for {num_pages} pages")
        return event["pages"], event["slot"]

    def done(self, room: int, timeout_s: float = 30.0) -> dict[str, Any]:
        return self.wait_event(lambda e: e["event"] == "done" and e["room"] == room, timeout_s)

    def dump(self, path: Path) -> None:
        self.command(cmd="dump", path=str(path))
        self.wait_event(lambda e: e["event"] == "dumped")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command(cmd="exit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# -- the contract harness (tests/transfer_harness.py) ---------------------------------------


class _MooncakeSession(InProcessDecode):
    """Prefill manager and a real decode manager, each with its own engine, over loopback TCP."""

    decode: MooncakeDecodeManager

    def __init__(self, layout: KVLayout) -> None:
        self.server = BootstrapServer()
        self.bootstrap_addr = self.server.address
        self.prefill_pool = make_pool(layout=layout)
        self.prefill_metadata = MetadataBuffers(NUM_SLOTS)
        self.manager = MooncakeKVManager(self.prefill_pool, self.prefill_metadata)
        self.manager.register_to_bootstrap(self.bootstrap_addr)
        self.server.add_refusal_listener(self.manager.peer_refused)  # as build_prefill does
        self.decode_pool = make_pool(2 * NUM_PAGES, layout=layout)
        self.decode_metadata = MetadataBuffers(2 * NUM_SLOTS)
        self.decode_slots = SlotAllocator(2 * NUM_SLOTS)
        self.decode = MooncakeDecodeManager(
            self.decode_pool, self.decode_metadata, self.bootstrap_addr
        )
        self.receivers = {}
        self.destinations = {}

    def late_message(self, room: int) -> None:
        for receiver in self.receivers.pop(room, []):
            # A decode that gave up late: the Abort reaches a prefill that already cleared the
            # room. Sent directly, because this receiver concluded and would not send it.
            self.decode._peers.send_all(wire.Abort(room, self.decode.session))
            receiver.clear()

    def close(self) -> None:
        self.manager.close()
        self.decode.close()
        self.server.close()


class MooncakeHarness:
    moves_data = True
    plays_decode = True
    marks: tuple[pytest.MarkDecorator, ...] = (pytest.mark.mooncake,)

    def __init__(self, layout: KVLayout = KVLayout.LAYER_MAJOR) -> None:
        self.layout = layout
        self.name = layout_name("mooncake", layout)

    def make(self) -> HarnessSession:
        return _MooncakeSession(self.layout)
