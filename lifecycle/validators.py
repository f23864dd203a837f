"""attrs validators whose errors read as one line (``attrs.validators.in_`` raises a
``ValueError`` whose ``str`` is the tuple of its arguments, the attribute's repr among them),
and :func:`typed_fields`, which checks every field of a class against its annotation."""

from __future__ import annotations

import collections.abc
import types
import typing
from collections.abc import Callable, Collection
from typing import Any

import attrs


def one_of(options: Collection[Any]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """Raise ``ValueError("'name' must be one of ('a', 'b'), got 'c'")`` for a value not in
    ``options``."""
    allowed = tuple(options)

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name!r} must be one of {allowed!r}, got {value!r}")

    return check


def of_type(kinds: type | tuple[type, ...], name: str) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: ``value`` is one of ``kinds`` (a bool is a bool, not a number), so
    a wrong type is refused where the object is built, not where it is first used; ``name``
    says what is wanted."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, kinds) or (isinstance(value, bool) and name != "a bool"):
            raise TypeError(f"{attribute.name} must be {name}, got {value!r:.40} "
                            f"({type(value).__name__})")

    return check


def typed_fields(cls: type, fields: list[attrs.Attribute[Any]]) -> list[attrs.Attribute[Any]]:
    """An attrs ``field_transformer``: every field's value must have its annotated type, checked
    before the field's own validator (``@attrs.frozen(field_transformer=typed_fields)``).

    A configuration is often built from text (an environment variable, a file): ``"no"`` for a
    bool is true, ``"16"`` for an int fails in the first comparison with a message that names
    no field, and ``16.0`` passes every bound and fails in torch. The check is shallow (a
    ``tuple[int, ...]`` is a tuple of ints, other containers only their kind); a bool is not a
    number, an int is a float, ``X | None`` is understood, a ``Literal`` field's type is that of
    its values (which values, the field's own validator says), ``Any`` takes anything."""
    return [field.evolve(validator=_first(_TypeCheck(cls, field.name), field.validator))
            for field in fields]


def _first(check: Callable[[Any, Any, Any], None],
           then: Callable[[Any, Any, Any], None] | None) -> Callable[[Any, Any, Any], None]:
    return check if then is None else attrs.validators.and_(check, then)


class _TypeCheck:
    """The validator :func:`typed_fields` gives a field (its annotation resolved at first use,
    when every name it mentions exists)."""

    def __init__(self, cls: type, name: str) -> None:
        self._cls, self._name = cls, name
        self._hint: Any = _UNRESOLVED

    def __call__(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if self._hint is _UNRESOLVED:
            self._hint = typing.get_type_hints(self._cls)[self._name]
        if not _is(value, self._hint):
            raise TypeError(f"{type(instance).__name__}.{attribute.name} must be "
                            f"{_describe(self._hint)}, got {value!r:.40} "
                            f"({type(value).__name__})")


_UNRESOLVED = object()


def _is(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, arm) for arm in typing.get_args(hint))
    if origin is typing.Literal:  # the type: which of the values is the field's own check
        return any(_is(value, type(option)) for option in typing.get_args(hint))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is(item, args[0]) for item in value)
        return len(args) == len(value) and all(map(_is, value, args))
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    return isinstance(value, origin if isinstance(origin, type) else hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(hint))
    if origin is typing.Literal:
        return " or ".join(sorted({_describe(type(o)) for o in typing.get_args(hint)}))
    if hint is None or hint is type(None):
        return "None"
    named = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}
    if hint in named:
        return named[hint]
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return "a tuple of " + _plural(args[0])
        return "a tuple of " + ", ".join(map(_describe, args))
    name = getattr(hint, "__name__", str(hint))
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _plural(hint: Any) -> str:
    named = {bool: "bools", int: "integers", float: "numbers", str: "strings"}
    return named.get(hint) or _describe(hint) + " each"
