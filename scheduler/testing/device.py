"""A device whose forwards run when the test says so: the fuzzing machine's clock for the device.

The overlap loop hands each forward to a device and lands the result one pass later. On the
production :class:`~scheduler.prefill.forward.DeviceWorker` the forward runs on a thread, so
*when* it runs — before or after the next rule makes the next forward fail, say — depends on the
operating system, and a Hypothesis search that depends on it cannot replay or shrink.
:class:`SteppedDevice` runs no thread. A forward runs at one of two defined points:

* a rule finishes the oldest pending forward (:meth:`SteppedDevice.finish_next`): the device got
  there before the scheduler asked;
* the scheduler waits for a result (:meth:`SteppedJob.result`): every forward submitted up to
  that one runs then, in order, as a serial device would finish them.

Both happen on the caller's thread, so every run of the same program makes the same calls in the
same order. Forwards run in submission order, like the one worker of the real device.
"""

from __future__ import annotations

import collections

from scheduler.prefill.forward import Forward
from scheduler.runner import ForwardBatch


class SteppedJob:
    """One forward handed to a :class:`SteppedDevice`; it runs once, when first due."""

    def __init__(self, device: SteppedDevice, forward: Forward, batch: ForwardBatch) -> None:
        self._device = device
        self._forward = forward
        self.batch = batch
        self.done = False
        self._tokens: list[int] | None = None
        self._error: Exception | None = None

    def __repr__(self) -> str:
        rids = [item.rid for item in self.batch.items]
        return f"SteppedJob({rids}, {'done' if self.done else 'pending'})"

    def run(self) -> None:
        if self.done:
            return
        try:
            self._tokens = self._forward(self.batch)
        except Exception as exc:  # delivered through result(), as a device error would be
            self._error = exc
        self.done = True

    def result(self) -> list[int]:
        self._device.finish_through(self)
        if self._error is not None:
            raise self._error
        assert self._tokens is not None
        return self._tokens


class SteppedDevice:
    """A :class:`~scheduler.prefill.forward.Device` that runs forwards only when told to, or
    when a result is waited for (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: collections.deque[SteppedJob] = collections.deque()
        self.finished = 0  # forwards run so far
        self.closed = False

    def submit(self, forward: Forward, batch: ForwardBatch) -> SteppedJob:
        if self.closed:
            raise RuntimeError("submit() after shutdown()")
        job = SteppedJob(self, forward, batch)
        self._pending.append(job)
        return job

    @property
    def busy(self) -> bool:
        """A submitted forward has not run yet."""
        return bool(self._pending)

    def finish_next(self) -> SteppedJob:
        """Run the oldest forward that has not run; it is an error to call this when idle."""
        job = self._pending.popleft()
        job.run()
        self.finished += 1
        return job

    def finish_through(self, job: SteppedJob) -> None:
        """Run every pending forward up to and including ``job``."""
        while not job.done:
            self.finish_next()

    def shutdown(self) -> None:
        while self._pending:
            self.finish_next()
        self.closed = True
