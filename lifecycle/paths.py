"""Test paths generated from a table: shortest, edge-covering event sequences.

For every edge, :func:`edge_paths` finds the shortest sequence of edges from the initial state
that ends by taking it (breadth-first over the states, edges in table order, so the result is
deterministic). Paths that are a prefix of another path are dropped, since the longer one takes
the same edges; what remains covers every edge of the table, shortest first. Tests parametrize
over them and walk each one on a real lifecycle, asserting the whole state after every step.

Paths ignore guards: a walker makes each step's guards hold before firing it (for the prefill
table, ``computed`` decides between ``chunk_done`` and ``prefilled``).
"""

from __future__ import annotations

import enum
from collections import deque

import attrs

from lifecycle.errors import LifecycleError
from lifecycle.table import Edge, LifecycleTable


@attrs.frozen(repr=False)
class TestPath:
    """A walk from the initial state: the edges taken, in order."""

    __test__ = False  # not a pytest test class, despite the name

    edges: tuple[Edge, ...]

    def __repr__(self) -> str:
        """The walk as the diagrams draw it, ``TestPath(NEW --go--> RUN --finish--> DONE)``
        (every field of every edge, as attrs would write it, buries the walk)."""
        if not self.edges:
            return "TestPath()"
        steps = "".join(f" --{e.event}--> {e.dest.name}" for e in self.edges)
        return f"TestPath({self.edges[0].source.name}{steps})"

    @property
    def events(self) -> tuple[str, ...]:
        return tuple(e.event for e in self.edges)

    @property
    def states(self) -> tuple[enum.IntEnum, ...]:
        """The states after each step (the initial state is not included)."""
        return tuple(e.dest for e in self.edges)

    @property
    def name(self) -> str:
        """A readable id, e.g. ``bootstrapped>schedule>fail``."""
        return ">".join(self.events)


def _shortest_prefixes(table: LifecycleTable) -> dict[enum.IntEnum, tuple[Edge, ...]]:
    """For every state, the first-found shortest edge sequence from the initial state."""
    prefix: dict[enum.IntEnum, tuple[Edge, ...]] = {table.initial: ()}
    todo = deque([table.initial])
    while todo:
        state = todo.popleft()
        for e in table.edges:
            if e.source is state and e.dest not in prefix:
                prefix[e.dest] = (*prefix[state], e)
                todo.append(e.dest)
    return prefix


def edge_paths(table: LifecycleTable) -> tuple[TestPath, ...]:
    """Shortest paths that together take every edge of ``table``, shortest first."""
    prefix = _shortest_prefixes(table)
    candidates = [TestPath((*prefix[e.source], e)) for e in table.edges]
    kept = [
        p
        for p in candidates
        if not any(
            len(q.edges) > len(p.edges) and q.edges[: len(p.edges)] == p.edges for q in candidates
        )
    ]
    # sorted() is stable: equal lengths keep the table's edge order.
    return tuple(sorted(kept, key=lambda p: len(p.edges)))


def shortest_paths_to(table: LifecycleTable, state: enum.IntEnum) -> tuple[TestPath, ...]:
    """Every shortest path from the initial state to ``state`` (none for the initial state),
    in table edge order."""
    if not isinstance(state, table.states):
        raise LifecycleError(f"{table.name}: {state!r} is not a state of this table")
    paths: dict[enum.IntEnum, list[tuple[Edge, ...]]] = {table.initial: [()]}
    frontier = [table.initial]
    while frontier and state not in paths:
        layer: dict[enum.IntEnum, list[tuple[Edge, ...]]] = {}
        for src in frontier:
            for e in table.edges:
                if e.source is src and e.dest not in paths:
                    layer.setdefault(e.dest, []).extend((*p, e) for p in paths[src])
        paths.update(layer)
        frontier = list(layer)
    if state is table.initial:
        return ()
    return tuple(TestPath(p) for p in paths.get(state, []))
