"""attrs validators whose errors read as one line: ``attrs.validators.in_`` raises a
``ValueError`` whose ``str`` is the tuple of its arguments (the attribute's repr among them)."""

from __future__ import annotations

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
