"""Binding a table to code: guards on the record class, hooks of the owner, trigger methods.

Rules of this module
--------------------
1. A guard is a plain method of the record class, ``def g(self) -> bool`` or
   ``def g(self, event) -> bool``; a hook is any callable ``hook(req)`` or
   ``hook(req, event)``. Which of the two forms a callable has is read from its signature once,
   when the table is bound (:func:`check_guards`, :func:`hook_takes_event`), and every firing
   path calls it the same way; ``event`` is a :class:`Firing`.
2. Names are checked when the binding is made, never when an event fires: a guard the record
   class does not have, or a callable of another shape, raises
   :class:`~lifecycle.errors.InvalidTable` (guards) or :class:`~lifecycle.errors.MissingHook`
   (hooks) before anything fires.
3. A record class bound to a table gets one trigger method per event (:func:`install_triggers`):
   ``order.pay()`` is ``order.fire("pay")``. mypy cannot see methods made at run time; a class
   that wants it to declares them as ``pay: ClassVar[Trigger]``, and each such declaration is
   checked against the table's events.

This module knows names and classes, not tables, so the table module can use it.
"""

from __future__ import annotations

import difflib
import enum
import inspect
import keyword
import re
import typing
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol

import attrs

from lifecycle.errors import InvalidTable, MissingHook
from lifecycle.weak import PerObject

#: Attributes of every record; an event may not have one of these names.
RESERVED = frozenset({"rid", "state", "reason", "detail", "timeline", "owner", "is_final", "fire"})

#: The event name a timeline's first entry carries: the request's admission into its lifecycle
#: (no event may have this name, or a timeline would not say which it was).
ADMITTED = "admitted"

_TRIGGER_ANNOTATION = re.compile(r"(typing\.)?ClassVar\[\s*(lifecycle\.)?Trigger\s*\]")


@attrs.frozen
class Firing:
    """What a guard or hook that takes a second argument is told: ``event`` is being fired to
    move a request from ``source`` to ``dest``, with ``reason`` and ``detail`` (set only on
    edges into a final state)."""

    event: str
    source: enum.IntEnum
    dest: enum.IntEnum
    reason: enum.Enum | None = None
    detail: str = ""


class Trigger(Protocol):
    """The type of a generated trigger method; declare ``pay: ClassVar[Trigger]`` on a record
    class so that mypy sees ``order.pay()``. Calling it fires the event for that one request;
    ``detail`` and ``reason`` go with an event into a final state."""

    def __call__(self, detail: str = "", *, reason: enum.Enum | None = None) -> None: ...


# How alike two names must be (difflib's ratio) for one to be offered for the other: a letter
# missing, doubled or swapped in a short name ('fial' for 'fail' is 0.75), not a shared
# syllable ('scan' for 'cancel' is 0.6).
_CLOSE = 0.75


def _closest(name: str, choices: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=_CLOSE)
    return close[0] if close else None


def suggest(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to a misspelt ``name``, or ``""``."""
    close = _closest(name, choices)
    return f" (did you mean {close!r}?)" if close else ""


def _respellings(misspelt: Iterable[str], meant: Iterable[str]) -> str:
    """`` (did you mean 'notify' where you gave 'notfy'?)`` for each name of ``misspelt`` close
    to one of ``meant``, or ``""``."""
    meant = list(meant)
    pairs = [(close, given) for given in misspelt if (close := _closest(given, meant))]
    return "".join(f" (did you mean {close!r} where you gave {given!r}?)"
                   for close, given in pairs)


# Per callable (the function of a bound method), per bound or not: whether it takes the event.
# Reading a signature is slow, and lifecycles are built often (one per fuzzed example) from the
# same functions, so each callable's own signature is read once; not once per code object, which
# every wrapper a decorator makes (functools.wraps) shares, each wrapping another function.
_FORMS: PerObject[object, dict[bool, bool]] = PerObject()


def _takes_event(fn: Callable[..., Any], first: str, what: str) -> bool:
    """Whether ``fn`` takes a second positional argument after its ``first`` one, read from its
    own signature (a wrapper's, through ``__wrapped__``); raise ``ValueError`` naming ``what``
    if it cannot be called with one or two arguments."""
    target = getattr(fn, "__func__", fn)
    bound = hasattr(fn, "__self__")
    forms = _FORMS.get(target)
    if forms is not None and bound in forms:
        return forms[bound]
    takes = _read_form(fn, first, what)
    if forms is None:
        try:
            forms = _FORMS.put(target, {})
        except TypeError:  # it cannot be weakly referenced (a builtin): read it every time
            return takes
    forms[bound] = takes
    return takes


def _read_form(fn: Callable[..., Any], first: str, what: str) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False  # no signature to read (a builtin): call it with the one argument
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    star = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    kw_required = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
    ]
    if len(required) > 2 or kw_required or (not positional and not star):
        raise ValueError(f"{what} must take ({first}) or ({first}, event)")
    return star or len(positional) >= 2


def check_guards(table: str, guards: Mapping[str, str], record: type) -> dict[str, bool]:
    """Check that every guard (name → the event whose edge names it) is a plain method of
    ``record``; return, per guard, whether it takes the event argument."""
    out: dict[str, bool] = {}
    for name, event in guards.items():
        where = f"{table}: guard {name!r} of event {str(event)!r}"
        static = inspect.getattr_static(record, name, None)
        if static is None:
            methods = [n for n in dir(record) if not n.startswith("_")]
            raise InvalidTable(
                f"{where} is not a method of {record.__name__}{suggest(name, methods)}"
            )
        if not inspect.isfunction(static):
            raise InvalidTable(
                f"{where}: {record.__name__}.{name} is a {type(static).__name__}, not a "
                f"method: write def {name}(self) or def {name}(self, event)"
            )
        try:
            out[name] = _takes_event(static, "self", f"{where}: {record.__name__}.{name}")
        except ValueError as exc:
            raise InvalidTable(str(exc)) from None
    return out


def hook_takes_event(table: str, name: str, hook: Callable[..., Any]) -> bool:
    """Whether the hook ``name`` takes the event argument; raise
    :class:`~lifecycle.errors.MissingHook` if it is not callable, or takes neither one argument
    nor two."""
    if not callable(hook):
        raise MissingHook(
            f"{table}: hook {name!r} is not callable (got {type(hook).__name__} {hook!r}); "
            f"give a function hook(req) or hook(req, event)"
        )
    try:
        return _takes_event(hook, "req", f"{table}: hook {name!r}")
    except ValueError as exc:
        raise MissingHook(str(exc)) from None


def hooks_take_event(
    table: str, named: Iterable[str], given: Mapping[str, Callable[..., Any]]
) -> dict[str, bool]:
    """Per hook ``given``, whether it takes the event argument; raise
    :class:`~lifecycle.errors.MissingHook` if a hook the table names (``named``) is missing,
    one given is not named, or one is not callable or takes neither one argument nor two."""
    named = set(named)
    missing = sorted(named - given.keys())
    unknown = sorted(given.keys() - named)
    if missing:
        raise MissingHook(f"{table}: the table names hooks not supplied: {missing}"
                          f"{_respellings(unknown, missing)}")
    if unknown:
        raise MissingHook(f"{table}: hooks supplied that the table does not name: {unknown}"
                          f"{_respellings(unknown, named)}")
    return {name: hook_takes_event(table, name, fn) for name, fn in given.items()}


def check_event_name(table: str, event: str) -> None:
    """Refuse an event name that cannot name a trigger method (not a Python identifier, a
    keyword, or a name Python reads otherwise in source: not its NFKC form), that every record
    already uses (:data:`RESERVED`), or that timelines use for the admission
    (:data:`ADMITTED`); raise :class:`~lifecycle.errors.InvalidTable` naming it."""
    name = str(event)
    where = f"{table}: event {name!r}"
    if not name.isidentifier():
        raise InvalidTable(
            f"{where} is not a Python identifier; an event names a trigger method "
            f"(req.<event>()), so use letters, digits and underscores"
        )
    if keyword.iskeyword(name):
        raise InvalidTable(f"{where} is a Python keyword, which cannot name a trigger method")
    # Python reads identifiers in NFKC form: ``req.ﬁnish()`` (a ligature) calls ``finish``.
    normal = unicodedata.normalize("NFKC", name)
    if normal != name:
        raise InvalidTable(
            f"{where} is not its own NFKC form {normal!r}: Python normalises identifiers, so "
            f"req.{name}() would call {normal}, not the trigger method of this event; name "
            f"the event {normal!r}"
        )
    if name.startswith("__") and name.endswith("__"):
        raise InvalidTable(
            f"{where} is a special method name (Python calls {name} itself); name the event "
            f"otherwise"
        )
    if name in RESERVED:
        raise InvalidTable(
            f"{where} is a name every record uses (Tracked.{name}); name the event otherwise"
        )
    if name == ADMITTED:
        raise InvalidTable(
            f"{where} is the name timelines give a request's admission "
            f"(lifecycle.ADMITTED); name the event otherwise"
        )


def _declared_triggers(record: type) -> set[str]:
    """The names ``record`` declares ``ClassVar[Trigger]``: as text (a module with ``from
    __future__ import annotations``) or as the evaluated annotation (one without)."""
    names = set()
    for klass in record.__mro__:
        for name, ann in vars(klass).get("__annotations__", {}).items():
            if isinstance(ann, str):
                declared = bool(_TRIGGER_ANNOTATION.fullmatch(ann.strip()))
            else:
                declared = typing.get_origin(ann) is ClassVar and typing.get_args(ann) == (
                    Trigger,)
            if declared:
                names.add(name)
    return names


def _trigger(event: str, doc: str) -> Callable[..., None]:
    def trigger(self: Any, detail: str = "", *, reason: enum.Enum | None = None) -> None:
        if not isinstance(detail, str):
            raise TypeError(
                f"{event}(): detail is a string; pass the reason by keyword (reason=...)"
            )
        owner = self.owner
        if owner is None:
            self.fire(event, reason=reason, detail=detail)  # names the unadmitted request
        else:  # what ``fire`` would call, one call fewer on the one-request path
            owner.trigger(self, event, reason=reason, detail=detail)

    trigger.__name__ = trigger.__qualname__ = event
    trigger.__doc__ = f"Fire {event!r} for this request{': ' + doc if doc else ''}."
    trigger._lifecycle_trigger = True  # type: ignore[attr-defined]
    return trigger


def _field_names(record: type) -> set[str]:
    """The record's attrs fields and its annotated names other than trigger declarations."""
    names = {f.name for f in attrs.fields(record)} if attrs.has(record) else set()
    for klass in record.__mro__:
        names |= {n for n in vars(klass).get("__annotations__", {}) if n not in RESERVED}
    return names - _declared_triggers(record)


def _what(existing: object) -> str:
    if isinstance(existing, property):
        return "a property"
    if isinstance(existing, (staticmethod, classmethod)) or inspect.isfunction(existing):
        return "a method"
    return f"a class attribute, {type(existing).__name__}"


def install_triggers(table: str, events: Mapping[str, str], record: type) -> None:
    """Give ``record`` one trigger method per event (event name → its doc), checking the
    ``ClassVar[Trigger]`` declarations against the events and refusing a name the class
    already uses for something else."""
    if not callable(getattr(record, "fire", None)):
        raise InvalidTable(
            f"{table}: record class {record.__name__} has no fire method; derive it from "
            f"lifecycle.Tracked"
        )
    for name in sorted(_declared_triggers(record) - set(events)):
        raise InvalidTable(
            f"{table}: {record.__name__}.{name} is declared a Trigger, but the table has no "
            f"event {name!r}{suggest(name, events)}; declare the table's events only (records "
            f"of two tables declare each table's triggers on a subclass of their own)"
        )
    for event, doc in events.items():
        # (The table's validation refused event names that are not identifiers or are
        # reserved: check_event_name.)
        if event in _field_names(record):
            raise InvalidTable(
                f"{table}: {record.__name__}.{event} is a field of the record, and event "
                f"{event!r} makes a trigger method of that name; rename one of them"
            )
        existing = inspect.getattr_static(record, event, None)
        if existing is not None and not getattr(existing, "_lifecycle_trigger", False):
            raise InvalidTable(
                f"{table}: {record.__name__}.{event} already exists ({_what(existing)}); "
                f"event {event!r} makes a trigger method of that name, so rename one of them "
                f"(the table writes the method: to declare it for mypy, write only "
                f"{event}: ClassVar[Trigger])"
            )
        setattr(record, event, _trigger(event, doc))
