"""What the prefill and decode tables share: the frame of a served request's lifecycle.

A request is admitted in BOOTSTRAPPING and walks its side's own path of edges to DONE;
``fail`` and ``abort`` are legal from every live state and lead to FAILED; entering DONE or
FAILED runs the ``release`` and ``respond`` hooks, exactly once; a failed request's reason is a
:class:`~lifecycle.reasons.FailureReason`. :func:`request_table` adds that frame to a path.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from lifecycle.reasons import FailureReason
from lifecycle.table import Edge, LifecycleTable, make_table


def request_table(
    name: str,
    states: type[enum.IntEnum],
    events: type[enum.StrEnum],
    *,
    path: Iterable[Edge],
    fail_doc: str,
    record: type,
) -> LifecycleTable:
    """The table of a served request: ``path`` from BOOTSTRAPPING to DONE, then ``fail`` (when
    ``fail_doc`` says) and ``abort`` from every live state to FAILED.

    ``states`` must have BOOTSTRAPPING, DONE and FAILED; ``events`` FAIL and ABORT. The live
    states are all the others, in their enum's order.
    """
    failed, finals = states["FAILED"], (states["DONE"], states["FAILED"])
    fail, abort = events["FAIL"], events["ABORT"]
    live = [s for s in states if s not in finals]
    return make_table(
        name,
        states,
        events=events,
        initial=states["BOOTSTRAPPING"],
        finals=finals,
        edges=(
            *path,
            *(Edge(fail, s, failed, doc=fail_doc) for s in live),
            *(Edge(abort, s, failed, doc="the client or router aborted") for s in live),
        ),
        failure_events=(fail, abort),
        on_enter={done_or_failed: ("release", "respond") for done_or_failed in finals},
        reasons=FailureReason,
        record=record,
    )
