"""Typed errors of the lifecycle core."""

from __future__ import annotations

import enum


class LifecycleError(Exception):
    """Base class of every error raised by :mod:`lifecycle`."""


class IllegalTransition(LifecycleError):
    """An event was fired at a request whose state has no such edge; nothing changed.

    Carries the request id, its state and the event so the caller can tell which request and
    what it tried; the fix is always in the caller (the scheduler fired out of order).
    """

    def __init__(self, rid: str, state: enum.Enum, event: str, why: str = "") -> None:
        self.rid = rid
        self.state = state
        self.event = event
        self.why = why
        detail = f": {why}" if why else ""
        super().__init__(
            f"request {rid!r} in state {state.name} cannot take event {event!r}{detail}"
        )


class GuardFailed(IllegalTransition):
    """The edge exists, but one of its conditions is false for this request."""


class InvalidTable(LifecycleError):
    """A lifecycle table breaks a definition rule; the message names the state or edge."""


class MissingHook(LifecycleError):
    """The table names a callback that the lifecycle was not given."""
