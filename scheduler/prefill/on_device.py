"""FORWARD·on-device: the sub-state of a request whose batch is on the device.

The prefill table shows FORWARD as one state. Inside it, a request is *on the device* while
launched batches that hold it have not had their results processed yet
(``PrefillRequest.on_device`` counts them: under the overlap loop a chunked request can have
two, the previous batch and the one just launched). A forward may be writing its pages then, so
a failure that arrives meanwhile — the client's abort, the decode peer's, a deadline, a failed
transfer poll, the forward's own error — cannot free them. It is *deferred*
(``pending_abort`` holds the first such reason, ``detail`` its message) and *settled* — the
``abort`` or ``fail`` edge fired — when the last of those batches lands.

::

    FORWARD ──put_on_device──► FORWARD·on-device ──take_off_device (last)──► FORWARD
                                      │ defer_failure(reason)
                                      ▼
                   FORWARD·on-device, failure deferred ──take_off_device (last)──►
                   settle_failure ──► abort | fail ──► FAILED

This module is the one owner of the two fields: the scheduler counts launches and landings,
defers failures and settles them through these functions, and nothing else writes them.
"""

from __future__ import annotations

from lifecycle import FailureReason, PrefillRequest


def put_on_device(req: PrefillRequest) -> None:
    """A batch holding ``req`` was handed to the device."""
    req.on_device += 1


def take_off_device(req: PrefillRequest) -> bool:
    """A batch holding ``req`` came off the device; True when that was the last one and a
    deferred failure is now due (call :func:`settle_failure`)."""
    if req.on_device <= 0:
        raise AssertionError(f"{req.rid}: a batch landed that was never launched")
    req.on_device -= 1
    return req.on_device == 0 and req.pending_abort is not None


def defer_failure(req: PrefillRequest, reason: FailureReason, detail: str) -> bool:
    """Defer a failure of ``req`` while it is on the device (the first one wins); False when
    it is not on the device and the failure may take effect now."""
    if not req.on_device:
        return False
    if req.pending_abort is None:
        req.pending_abort = reason
        req.detail = detail
    return True


def failure_deferred(req: PrefillRequest) -> bool:
    """A failure of ``req`` is waiting for its batches to land: schedule nothing more of it."""
    return req.pending_abort is not None


def settle_failure(req: PrefillRequest) -> tuple[FailureReason, str]:
    """Take the deferred failure of a request that is off the device: (reason, detail)."""
    reason = req.pending_abort
    if reason is None or req.on_device:
        raise AssertionError(
            f"{req.rid}: settle() with pending_abort={reason} on_device={req.on_device}"
        )
    req.pending_abort = None
    return reason, req.detail
