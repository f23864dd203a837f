"""Typed errors of the lifecycle core."""

from __future__ import annotations

import enum
from collections.abc import Sequence


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
            f"request {rid!r} in state {state.name} cannot take event {str(event)!r}{detail}"
        )


class GuardFailed(IllegalTransition):
    """The edge exists, but one of its guards refused this request; ``why`` names each guard
    that refused (from the one evaluation that decided)."""


class InvalidTable(LifecycleError):
    """A lifecycle table breaks a definition rule, or names a guard its record class does not
    have; the message names the state, edge or guard."""


class MissingHook(LifecycleError):
    """The hooks given to a lifecycle do not fit its table: one it names is missing, one given
    is not in it, or one is not callable, or cannot be called as ``hook(req)`` or
    ``hook(req, event)``."""


class HookFailed(LifecycleError):
    """Hooks raised while an event was fired. The event had taken effect for every request it
    was fired for (they are in the edge's destination) and every hook of every one of them was
    called once; ``errors`` holds ``(rid, hook name, exception)`` for each hook that raised, in
    the order they ran, and the first is also this exception's ``__cause__``. (Where a hook
    raised a ``BaseException`` that is not an ``Exception``, such as ``KeyboardInterrupt``, the
    call raises that instead, once every hook ran, with a note naming the others.)"""

    def __init__(
        self, event: str, dest: enum.Enum, errors: Sequence[tuple[str, str, BaseException]]
    ) -> None:
        self.event = event
        self.dest = dest
        self.errors = tuple(errors)
        first_rid, first_hook, first_exc = self.errors[0]
        others = len(self.errors) - 1
        more = f" (and {others} more hook error{'s' if others > 1 else ''})" if others else ""
        # The hook's error goes last, after a sentence of its own: its text may hold colons,
        # semicolons and request ids of its own, and ran into what followed it.
        first = "first error" if others else "error"
        super().__init__(
            f"hook {first_hook!r} raised for request {first_rid!r}{more}; event {str(event)!r} "
            f"took effect: every request it was fired for is in {dest.name}. The {first}: "
            f"{type(first_exc).__name__}: {first_exc}"
        )
