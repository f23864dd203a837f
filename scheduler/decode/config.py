"""Decode peer configuration, validated when built."""

from __future__ import annotations

import attrs
from attrs.validators import gt

from lifecycle.validators import typed_fields


@attrs.frozen(field_transformer=typed_fields)
class DecodeConfig:
    """Limits of the decode peer.

    ``max_running_requests`` caps the requests past PREALLOC (receiving or decoding);
    ``waiting_timeout`` is how many seconds a request may wait from admission for its KV before
    it fails: ``transfer_timeout`` ("no KV from prefill") once its destination went to
    prefill or while it bootstraps, ``bootstrap_timeout`` ("no decode pages for it") while it
    still waits in PREALLOC for this side's pages, metadata slot or running place (its
    destination never went out); ``check_invariants`` checks the lifecycle invariants after
    every event (tests and fuzzing; costs time).
    """

    max_running_requests: int = attrs.field(default=256, validator=gt(0))
    waiting_timeout: float = attrs.field(default=300.0, validator=gt(0))
    check_invariants: bool = False
