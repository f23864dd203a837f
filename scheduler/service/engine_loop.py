"""The engine loop: the one thread that owns and steps the schedulers of a service.

Theory of operation
-------------------
A :class:`~scheduler.prefill.PrefillScheduler` or :class:`~scheduler.decode.DecodePeer` is
single-threaded: only :meth:`submit` and :meth:`abort` may be called from other threads. The
:class:`EngineLoop` thread is the one that steps them. Each pass steps every engine once, then
runs the ``after_pass`` hook (still on this thread, so it may read engine state).

Waiting: other threads call :meth:`EngineLoop.wake` after they submit or abort. A pass that did
no work blocks on that wake-up: without a deadline when every engine is idle, and for
``poll_interval`` seconds while requests are live (the KV layer's readiness queues cannot wake
the loop, so live requests are polled at that cadence). The wake-up is cleared *before* a pass,
so a submit that lands during the pass makes the following wait return at once.

Failure: an exception out of a pass ends the loop; it is logged, kept in :attr:`failure`, and
handed to ``on_crash`` (which fails the requests waiting on this loop), so a dead loop is
always visible, never silent. Another thread that finds what the engines depend on dead (a rank
process) calls :meth:`EngineLoop.fail`: the loop wakes and ends the same way, on its own
thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

#: How often live requests are polled for KV readiness when a pass found nothing to do.
POLL_INTERVAL_S = 0.001


class Steppable(Protocol):
    """What the loop asks of a scheduler (a prefill scheduler or a decode peer)."""

    def step(self) -> bool: ...

    def idle(self) -> bool: ...


class EngineLoop:
    """Steps ``engines`` on a thread of its own until :meth:`stop` or a failure."""

    def __init__(
        self,
        engines: Sequence[Steppable],
        *,
        on_crash: Callable[[BaseException], None],
        after_pass: Callable[[], None] | None = None,
        poll_interval: float = POLL_INTERVAL_S,
        name: str = "pdlife-engine",
        outside_grace_s: float = 0.0,
    ) -> None:
        """``engines``: anything with ``step()`` and ``idle()``, stepped in order once each per
        pass (a prefill scheduler, a decode peer, an :class:`~scheduler.embedded.EmbeddedPair`).
        ``on_crash``: called once, on this thread, with the failure that ended the loop.
        ``after_pass``: called after every pass, on this thread (it may read the engines' state
        and take their answers); an exception out of it ends the loop as a failed pass does.
        ``poll_interval``: seconds to wait after a pass that did no work while an engine is
        not idle. ``name``: the thread's.

        ``outside_grace_s``: how long a failed pass waits for a failure found by another
        thread (:meth:`fail`), which, when it comes, is the one reported: a pass of a mesh
        whose rank process died fails in its collective ("connection closed by peer") a moment
        before the thread that watches the processes says which one exited."""
        if not engines:
            raise ValueError("engines: the loop needs at least one engine to step")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval}")
        self._engines = tuple(engines)
        self._on_crash = on_crash
        self._after_pass = after_pass
        self._poll_interval = poll_interval
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.failure: BaseException | None = None
        self._outside: BaseException | None = None  # a failure found by another thread
        self._outside_came = threading.Event()
        self._outside_grace_s = outside_grace_s
        self.passes = 0

    def start(self) -> None:
        """Start stepping, once: a loop does not start again (after :meth:`stop`, build a new
        one over the same engines)."""
        if self._thread.ident is not None:
            raise RuntimeError(f"EngineLoop {self._thread.name!r} was started already: a loop "
                               "runs once; build a new one to step its engines again")
        self._thread.start()

    def wake(self) -> None:
        """Make the loop run a pass soon (after a submit or an abort)."""
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def fail(self, exc: BaseException) -> None:
        """End the loop from another thread as if its next pass had raised ``exc`` (the loop
        wakes for it, idle or not)."""
        self._outside = exc
        self._outside_came.set()
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping and wait for the thread; the engines are left as they are."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine loop did not stop within {timeout} s")

    def _cause(self, exc: BaseException) -> BaseException:
        """What a failed pass reports: ``exc``, or the failure another thread finds within
        ``outside_grace_s`` (``exc`` its cause)."""
        if exc is self._outside or not self._outside_came.wait(self._outside_grace_s):
            return exc
        outside = self._outside
        assert outside is not None
        if outside.__cause__ is None:
            outside.__cause__ = exc
        return outside

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if self._outside is not None:
                    raise self._outside
                worked = False
                for engine in self._engines:
                    worked |= engine.step()
                if self._after_pass is not None:
                    self._after_pass()
                idle = not worked and all(e.idle() for e in self._engines)
            except BaseException as exc:  # any failure must reach the waiting requests
                failure = self._cause(exc)
                self.failure = failure
                logger.critical("the engine loop failed; the service is now unhealthy",
                                exc_info=failure)
                self._on_crash(failure)
                return
            self.passes += 1
            if not worked:
                self._wake.wait(None if idle else self._poll_interval)
