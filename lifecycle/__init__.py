"""pdlife's lifecycle core: table-driven request state machines, for any domain.

Pure: no torch, no I/O, no threads, nothing from ``kv`` or ``scheduler``. docs/framework.md
walks through defining a lifecycle of your own with it.
"""

from lifecycle.binding import Firing, Trigger
from lifecycle.decode import DECODE_TABLE, DecodeEvent, DecodeRequest, DecodeState
from lifecycle.errors import (
    GuardFailed,
    HookFailed,
    IllegalTransition,
    InvalidTable,
    LifecycleError,
    MissingHook,
)
from lifecycle.machine import Lifecycle
from lifecycle.prefill import (
    PREFILL_TABLE,
    TOKEN_IDS_LOGPROB_MAX,
    TOP_LOGPROBS_MAX,
    GrammarKind,
    GrammarSpec,
    PrefillEvent,
    PrefillRequest,
    PrefillState,
    SamplingParams,
)
from lifecycle.reasons import FailureReason
from lifecycle.record import ADMITTED, Tracked
from lifecycle.steps import shared_machine
from lifecycle.table import Edge, LifecycleTable, make_table, validate

TABLES = {"prefill": PREFILL_TABLE, "decode": DECODE_TABLE}

__all__ = [
    "ADMITTED",
    "DECODE_TABLE",
    "PREFILL_TABLE",
    "TABLES",
    "TOKEN_IDS_LOGPROB_MAX",
    "TOP_LOGPROBS_MAX",
    "DecodeEvent",
    "DecodeRequest",
    "DecodeState",
    "Edge",
    "FailureReason",
    "Firing",
    "GrammarKind",
    "GrammarSpec",
    "GuardFailed",
    "HookFailed",
    "IllegalTransition",
    "InvalidTable",
    "Lifecycle",
    "LifecycleError",
    "LifecycleTable",
    "MissingHook",
    "PrefillEvent",
    "PrefillRequest",
    "PrefillState",
    "SamplingParams",
    "Tracked",
    "Trigger",
    "make_table",
    "shared_machine",
    "validate",
]
