"""Driving a pass-based loop from the calling thread: step, and rest after an idle pass.

A scheduler pass returns whether it did any work. A pass that did none (a transfer still in
flight, a handshake not yet arrived) is followed by a short rest that yields the core to the
transfer workers and the device thread instead of spinning on the GIL. Every loop that steps a
scheduler or an embedded pair by hand goes through here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

#: How long a loop rests after a pass that did nothing (seconds).
IDLE_REST_S = 0.0002


def step_or_rest(step: Callable[[], bool]) -> bool:
    """Run one pass; after an idle one, rest :data:`IDLE_REST_S`. Returns what ``step`` did."""
    worked = step()
    if not worked:
        time.sleep(IDLE_REST_S)
    return worked


def step_until(
    step: Callable[[], bool],
    done: Callable[[], bool],
    timeout: float,
    timed_out: Callable[[], str] | None = None,
) -> None:
    """Step until ``done()``; raise ``TimeoutError`` after ``timeout`` wall seconds, with the
    message ``timed_out()`` (say what is still missing), or a plain one without it."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(timed_out() if timed_out is not None else
                               f"the condition did not hold within {timeout} s")
        step_or_rest(step)


class OneThread:
    """Refuses a pass begun while another thread is in one: ``step()`` belongs to one thread,
    and two threads inside one pass would corrupt the scheduler without an error. Reentrant on
    the thread that holds it. Cheap: one uncontended lock per pass.

    A pass left by a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``,
    ``SystemExit``: a signal reached the stepping thread, anywhere in the pass) may have left
    requests half-moved (a batch launched that never lands), so the guard then refuses every
    later pass: :attr:`interrupted` says by what."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.RLock()
        self._holder = ""
        self._doing: list[str] = []  # what the holder does, outermost first
        #: What interrupted a pass partway, if anything did (then no pass runs any more).
        self.interrupted: BaseException | None = None

    def __enter__(self) -> None:
        self._acquire("step()")
        if self.interrupted is not None:
            self._release()
            raise RuntimeError(
                f"{self._what}: a pass was interrupted by {self.interrupted!r} (a signal "
                "reached the thread stepping it), which may have left requests half-moved: it "
                "runs no more passes. Close it; step on a thread signals do not reach (an "
                "EngineLoop's) to survive one")

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        if exc is not None and not isinstance(exc, Exception):
            self.interrupted = exc
        self._release()

    @contextlib.contextmanager
    def holding(self, call: str) -> Iterator[None]:
        """Hold the stepping role on this thread for ``call`` (a ``close()`` that steps by
        itself): a pass begun on another thread meanwhile raises ``RuntimeError``, as does this
        if another thread is in a pass now."""
        self._acquire(call, f"is in {call}")
        try:
            yield
        finally:
            self._release()

    def _acquire(self, call: str, doing: str = "runs a pass") -> None:
        if not self._lock.acquire(blocking=False):
            holder_does = (self._doing or ["runs a pass"])[0]
            raise RuntimeError(
                f"{self._what}.{call} called on thread {threading.current_thread().name!r} "
                f"while thread {self._holder!r} {holder_does}: one thread steps it (submit "
                "and abort are the calls other threads may make)")
        self._holder = threading.current_thread().name
        self._doing.append(doing)

    def _release(self) -> None:
        self._doing.pop()
        self._lock.release()


class SteppedByOneThread:
    """What a scheduler stepped under a :class:`OneThread` (its ``_one_thread``) says of its
    stepping: whether a pass was interrupted, and a hold on the stepping role."""

    _one_thread: OneThread

    @property
    def interrupted(self) -> BaseException | None:
        """What interrupted a pass partway (``KeyboardInterrupt``, ``SystemExit``), if
        anything did: its requests may be half-moved, and no pass runs any more."""
        return self._one_thread.interrupted

    def holding(self, call: str) -> contextlib.AbstractContextManager[None]:
        """Hold the stepping role on this thread for ``call``: a ``step()`` on another thread
        meanwhile raises ``RuntimeError``, as does this if another thread is in a pass now."""
        return self._one_thread.holding(call)
