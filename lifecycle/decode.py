"""The decode lifecycle: the peer that receives the KV and continues generation.

Theory of operation
-------------------
The decode server gets the same request as the prefill server. It is admitted in
BOOTSTRAPPING while its receiver resolves the prefill side; ``bootstrapped`` moves it to
PREALLOC, where it waits for KV pages and a metadata slot; ``preallocated`` (destination sent
to prefill) moves it to RECEIVING; ``received`` (KV and metadata row landed, room validated)
to DECODING; ``finished`` (max_new_tokens, a stop token or string, EOS, or a completed grammar)
to DONE. ``fail`` and ``abort`` are legal from every live state. Entering DONE or FAILED runs
``release`` and ``respond`` once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from lifecycle.prefill import DEFAULT_SAMPLING, SamplingParams
from lifecycle.reasons import FailureReason
from lifecycle.record import Owner, Tracked
from lifecycle.request_table import request_table
from lifecycle.table import Edge


class DecodeState(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    PREALLOC = 2
    RECEIVING = 3
    DECODING = 4
    DONE = 5


class DecodeEvent(enum.StrEnum):
    """The events of :data:`DECODE_TABLE`."""

    BOOTSTRAPPED = "bootstrapped"
    PREALLOCATED = "preallocated"
    RECEIVED = "received"
    FINISHED = "finished"
    FAIL = "fail"
    ABORT = "abort"


@attrs.define(slots=True, eq=False, weakref_slot=False)
class DecodeRequest(Tracked):
    """A request on the decode peer: its prompt, its pages and slot, and its output so far.
    The trigger methods (``req.received()``, ...) come from :data:`DECODE_TABLE`.

    Give the fields after ``rid`` by keyword. As in :class:`~lifecycle.prefill.PrefillRequest`,
    they are not declared keyword-only and :class:`Tracked`'s own fields are declared again
    last: CPython fills a missing keyword-only argument's default by name, which made up a
    fifth of building a record that leaves most fields at their defaults.
    """

    input_ids: Sequence[int] = attrs.field(default=(), repr=False)
    bootstrap_host: str = attrs.field(default="")
    bootstrap_port: int = attrs.field(default=0)
    bootstrap_room: int = attrs.field(default=0)
    sampling: SamplingParams = attrs.field(default=DEFAULT_SAMPLING, repr=False)
    pages: list[int] = attrs.field(factory=list, repr=False)
    slot: int | None = attrs.field(default=None)
    receiver: object | None = attrs.field(default=None, repr=False)
    output_ids: list[int] = attrs.field(factory=list, repr=False)
    # Prompt tokens the prefill side found in its prefix cache (from the metadata row).
    cached_tokens: int = attrs.field(default=0)
    deadline: float | None = attrs.field(default=None)
    # Tracked's own fields, declared again to come last and not keyword-only (see above), the
    # failure reason narrowed to the table's.
    state: enum.IntEnum | None = attrs.field(default=None)
    reason: FailureReason | None = attrs.field(default=None)
    detail: str = attrs.field(default="")
    timeline: list[tuple[float, str]] = attrs.field(factory=list, repr=False)
    owner: Owner | None = attrs.field(default=None, repr=False)


_S = DecodeState
_E = DecodeEvent

DECODE_TABLE = request_table(
    "decode",
    DecodeState,
    DecodeEvent,
    path=(
        Edge(_E.BOOTSTRAPPED, _S.BOOTSTRAPPING, _S.PREALLOC,
             doc="the prefill side was resolved and the handshake done"),
        Edge(_E.PREALLOCATED, _S.PREALLOC, _S.RECEIVING,
             doc="pages and a metadata slot were allocated and sent to prefill"),
        Edge(_E.RECEIVED, _S.RECEIVING, _S.DECODING,
             doc="the KV and the metadata row landed; the room matched"),
        Edge(_E.FINISHED, _S.DECODING, _S.DONE,
             doc="max_new_tokens reached, a stop token or string, EOS, or a completed grammar"),
    ),
    fail_doc="transfer failure, timeout, internal error",
    record=DecodeRequest,
)
