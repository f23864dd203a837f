"""Driving a pass-based loop from the calling thread: step, and rest after an idle pass.

A scheduler pass returns whether it did any work. A pass that did none (a transfer still in
flight, a handshake not yet arrived) is followed by a short rest that yields the core to the
transfer workers and the device thread instead of spinning on the GIL. Every loop that steps a
scheduler or an embedded pair by hand goes through here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
    the thread that holds it. Cheap: one uncontended lock per pass."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.RLock()
        self._holder = ""

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{self._what}.step() called on thread {threading.current_thread().name!r} "
                f"while thread {self._holder!r} runs a pass: one thread steps it (submit and "
                "abort are the calls other threads may make)")
        self._holder = threading.current_thread().name

    def __exit__(self, *_exc: object) -> None:
        self._lock.release()
