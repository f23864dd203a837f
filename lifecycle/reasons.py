"""Why a request failed, and the HTTP status its client gets."""

from __future__ import annotations

import enum


class FailureReason(enum.Enum):
    """A failed request's reason. The value is the wire name; :attr:`http_status` is what the
    client is answered with."""

    REJECTED = "rejected"
    ABORTED = "aborted"
    BOOTSTRAP_FAILED = "bootstrap_failed"
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_TIMEOUT = "transfer_timeout"
    SHUTDOWN = "shutdown"
    INTERNAL = "internal"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]

    def __str__(self) -> str:
        # The wire name (``aborted``), as logs and messages should show it.
        return self.value


_HTTP_STATUS = {
    FailureReason.REJECTED: 400,
    # Client-side aborts are not server errors; SGLang answers them with 200 and
    # finish_reason "abort" where a body can still be sent.
    FailureReason.ABORTED: 200,
    FailureReason.BOOTSTRAP_FAILED: 500,
    FailureReason.BOOTSTRAP_TIMEOUT: 500,
    FailureReason.TRANSFER_FAILED: 500,
    FailureReason.TRANSFER_TIMEOUT: 500,
    FailureReason.SHUTDOWN: 503,
    FailureReason.INTERNAL: 500,
}

#: Every way a request ends, as ``(final state, reason)`` with the state's lower-case name and
#: the reason's wire name ("" for a request done): the labels of a counter of ended requests.
OUTCOMES: tuple[tuple[str, str], ...] = (("done", ""), *(("failed", r.value)
                                                        for r in FailureReason))
