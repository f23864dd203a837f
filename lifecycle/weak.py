"""What the lifecycle derives from an object, kept exactly as long as the object lives.

Tables, record classes and hooks are often built at run time (a test's, one per fuzzed
example, a service's per-tenant table); what the lifecycle derives from them once (a table's
``transitions`` machine, a callable's form) must go when they go. A :class:`PerObject` holds
each value under its object's identity with a weak reference to the object: no strong
reference keeps the object alive, and its entry is dropped as it dies. Looked up by identity,
not equality: a table is not hashable (its fields hold dicts), and two callables that compare
equal are still two callables with a signature each.

A value must not refer to its object (it would keep it alive, through the cache).
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class PerObject(Generic[K, V]):
    """Values by object identity, each dropped when its object dies."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[K], V]] = {}

    def get(self, obj: K) -> V | None:
        """The value kept for ``obj``, or None."""
        entry = self._entries.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return None

    def put(self, obj: K, value: V) -> V:
        """Keep ``value`` for ``obj`` while ``obj`` lives, and return it; ``TypeError`` if
        ``obj`` cannot be weakly referenced (then nothing is kept)."""
        key = id(obj)
        entries = self._entries

        def forget(ref: weakref.ref[K]) -> None:
            # Only this object's own entry: the id may have a newer entry by then.
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(obj, forget), value)
        return value

    def setdefault(self, obj: K, value: V) -> V:
        """The value kept for ``obj``; if there is none, keep ``value`` (:meth:`put`)."""
        kept = self.get(obj)
        return kept if kept is not None else self.put(obj, value)

    def __len__(self) -> int:
        return len(self._entries)
