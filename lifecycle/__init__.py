"""pdlife's lifecycle core: table-driven request state machines.

Pure: no torch, no I/O, no threads, nothing from ``kv`` or ``scheduler``.
"""

from lifecycle.decode import DECODE_TABLE, DecodeRequest, DecodeState
from lifecycle.errors import (
    GuardFailed,
    IllegalTransition,
    InvalidTable,
    LifecycleError,
    MissingHook,
)
from lifecycle.machine import Lifecycle, shared_machine
from lifecycle.prefill import PREFILL_TABLE, PrefillRequest, PrefillState, SamplingParams
from lifecycle.reasons import FailureReason
from lifecycle.record import Tracked
from lifecycle.table import Edge, LifecycleTable, make_table, validate

TABLES = {"prefill": PREFILL_TABLE, "decode": DECODE_TABLE}

__all__ = [
    "DECODE_TABLE",
    "PREFILL_TABLE",
    "TABLES",
    "DecodeRequest",
    "DecodeState",
    "Edge",
    "FailureReason",
    "GuardFailed",
    "IllegalTransition",
    "InvalidTable",
    "Lifecycle",
    "LifecycleError",
    "LifecycleTable",
    "MissingHook",
    "PrefillRequest",
    "PrefillState",
    "SamplingParams",
    "Tracked",
    "make_table",
    "shared_machine",
    "validate",
]
