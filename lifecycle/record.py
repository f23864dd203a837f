"""The part of a request record that the lifecycle owns.

Every lifecycle's request class derives from :class:`Tracked`: a slotted attrs class holding
the request id, the current state, the compact timeline and the owning
:class:`~lifecycle.machine.Lifecycle` (seen here through the :class:`Owner` protocol, so this
module does not import the machine that imports it). Subclasses add their domain fields and one
thin trigger method per event of their table (so an IDE and mypy see them); each trigger goes
through the table's one shared ``transitions.Machine``.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import attrs

from lifecycle.errors import LifecycleError
from lifecycle.reasons import FailureReason
from lifecycle.table import LifecycleTable


class Owner(Protocol):
    """What a record needs of the :class:`~lifecycle.machine.Lifecycle` that admitted it."""

    @property
    def table(self) -> LifecycleTable: ...

    def trigger(
        self, req: Any, event: str, *, reason: FailureReason | None = None, detail: str = ""
    ) -> None: ...

    def _entered_one(
        self, req: Any, src: enum.IntEnum, event: str, reason: FailureReason | None, detail: str
    ) -> None: ...


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Tracked:
    """A request as the lifecycle sees it.

    ``timeline`` holds ``(monotonic_time, event)`` pairs, the admission first with event
    ``""``. The states are not stored: every (state, event) pair has one destination, so the
    states follow from replaying the events through the table (:mod:`lifecycle.timeline`).
    """

    rid: str
    state: enum.IntEnum | None = attrs.field(default=None, kw_only=True)
    reason: FailureReason | None = attrs.field(default=None, kw_only=True)
    detail: str = attrs.field(default="", kw_only=True)
    timeline: list[tuple[float, str]] = attrs.field(factory=list, kw_only=True, repr=False)
    owner: Owner | None = attrs.field(default=None, kw_only=True, repr=False)

    @property
    def is_final(self) -> bool:
        owner = self.owner
        return owner is not None and self.state in owner.table.finals

    def _trigger(self, event: str, reason: FailureReason | None = None, detail: str = "") -> None:
        owner = self.owner
        if owner is None:
            raise LifecycleError(f"request {self.rid!r} was never admitted to a lifecycle")
        owner.trigger(self, event, reason=reason, detail=detail)

    def _after_transition(self, event_data: Any) -> None:
        # Called by the shared transitions.Machine after the state changed (trigger path).
        owner = self.owner
        assert owner is not None
        owner._entered_one(
            self,
            owner.table.states[event_data.transition.source],
            event_data.event.name,
            event_data.kwargs.get("reason"),
            event_data.kwargs.get("detail", ""),
        )
