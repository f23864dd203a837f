"""A Mooncake prefill rank whose transfer workers cannot all start (the process is out of
threads: ``RuntimeError: can't start new thread``) raises from its construction and leaves no
worker behind: those that started are stopped, not left blocked on their queues for ever, and
the manager closes what it opened as for any failed construction."""

from __future__ import annotations

import threading

import pytest

import kv.mooncake
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_engine import MooncakeConfig, MooncakeEngine, MooncakeError
from tests.transfer_harness import make_pool

pytestmark = pytest.mark.mooncake


def _fail_worker_start(monkeypatch: pytest.MonkeyPatch, nth: int) -> list[threading.Thread]:
    """Make the ``nth`` transfer worker's start fail as CPython's does when no thread can be
    had (any other thread starts as usual); the workers that did start, as they start."""
    real_start = threading.Thread.start
    started: list[threading.Thread] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("mooncake-xfer-"):
            if len(started) + 1 == nth:
                raise RuntimeError("can't start new thread")
            started.append(thread)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


@pytest.mark.parametrize("nth", [1, 2, 4])
def test_a_worker_that_cannot_start_leaves_no_worker_blocked(
    monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    engines: list[MooncakeEngine] = []

    class Recorded(MooncakeEngine):
        def __init__(self, config: MooncakeConfig) -> None:
            super().__init__(config)
            engines.append(self)

    monkeypatch.setattr(kv.mooncake, "MooncakeEngine", Recorded)
    before = set(threading.enumerate())
    started = _fail_worker_start(monkeypatch, nth)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        MooncakeKVManager(make_pool(), MetadataBuffers(8),
                          config=MooncakeConfig(num_workers=4, engines=2))
    assert len(started) == nth - 1
    # Stopped within the construction, which joined them.
    assert [t.name for t in started if t.is_alive()] == []
    # The manager's failed construction closed what it opened: the second engine too.
    (engine,) = engines
    with pytest.raises(MooncakeError, match="closed"):
        engine.submit_write("127.0.0.1:9", [1], [1], [1])
    assert [t.name for t in threading.enumerate() if t not in before and t.is_alive()] == []
