"""The part of a request record that the lifecycle owns.

Every lifecycle's request class derives from :class:`Tracked`: a slotted attrs class holding
the request id, the current state, how it ended (reason and detail), the compact timeline and
the owning :class:`~lifecycle.machine.Lifecycle` (seen here through the :class:`Owner`
protocol, so this module does not import the machine that imports it). Subclasses add their
domain fields and their guards; the trigger methods (``order.pay()``) come from the table
(``make_table(..., record=Order)``), and :meth:`Tracked.fire` fires any event by its name.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import attrs

from lifecycle.binding import ADMITTED as ADMITTED  # the admission's timeline entry
from lifecycle.errors import IllegalTransition, LifecycleError
from lifecycle.table import LifecycleTable


class Owner(Protocol):
    """What a record needs of the :class:`~lifecycle.machine.Lifecycle` that admitted it."""

    @property
    def table(self) -> LifecycleTable: ...

    def trigger(
        self, req: Any, event: str, *, reason: enum.Enum | None = None, detail: str = ""
    ) -> None: ...


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Tracked:
    """A request as the lifecycle sees it.

    ``timeline`` holds ``(monotonic_time, event)`` pairs, the admission first with event
    :data:`ADMITTED` (``"admitted"``). The states are not stored: every (state, event) pair
    has one destination, so the states follow from replaying the events through the table
    (:mod:`lifecycle.timeline`).
    ``reason`` and ``detail`` say how the request ended; they are set on entering a final
    state, from what that event was fired with. A subclass may narrow ``reason`` to its
    table's reason enum by declaring the field again.
    """

    rid: str
    state: enum.IntEnum | None = attrs.field(default=None, kw_only=True)
    reason: enum.Enum | None = attrs.field(default=None, kw_only=True)
    detail: str = attrs.field(default="", kw_only=True)
    timeline: list[tuple[float, str]] = attrs.field(factory=list, kw_only=True, repr=False)
    owner: Owner | None = attrs.field(default=None, kw_only=True, repr=False)

    @property
    def is_final(self) -> bool:
        owner = self.owner
        return owner is not None and self.state in owner.table.finals

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A record that ended is a value: pickled or copied, it leaves its lifecycle behind and
        # keeps only the table (:class:`Ended`), so ``is_final`` and a refused event still
        # read as before. A live one keeps its owner: copies cannot fire, and pickling it
        # meets the lifecycle's refusal (Lifecycle.__reduce__).
        reduced = super().__reduce_ex__(protocol)
        owner = self.owner
        if owner is None or isinstance(owner, Ended) or not self.is_final:
            return reduced
        return (*reduced[:2], _owned_by(reduced[2], Ended(owner.table)), *reduced[3:])

    def fire(self, event: str, *, reason: enum.Enum | None = None, detail: str = "") -> None:
        """Fire ``event`` (a member of the table's events enum, or its name) for this request,
        through its lifecycle; the trigger methods the table gives the class call this."""
        owner = self.owner
        if owner is None:
            raise LifecycleError(f"request {self.rid!r} was never admitted to a lifecycle")
        owner.trigger(self, event, reason=reason, detail=detail)


@attrs.frozen
class Ended:
    """The owner of a record pickled or copied after it ended: its table, without the lifecycle
    (its hooks, index and live requests), which stays where it was."""

    table: LifecycleTable

    def trigger(
        self, req: Any, event: str, *, reason: enum.Enum | None = None, detail: str = ""
    ) -> None:
        state = req.state
        raise IllegalTransition(req.rid, state, event, self.table.no_edge(state, event))


def _owned_by(state: Any, owner: Ended) -> Any:
    """An object's pickled state (a dict of its fields, or a ``(dict, slots)`` pair) with
    ``owner`` in place of the lifecycle."""
    if isinstance(state, dict) and "owner" in state:
        return {**state, "owner": owner}
    if isinstance(state, tuple):
        return tuple(_owned_by(part, owner) for part in state)
    return state
