"""The architecture as a check: imports point down, rooms import only rooms below them, and no
module imports itself back through others.

Every ``import`` counts, wherever it stands: at module level, inside a function (a lazy import is
still a dependency) or under ``TYPE_CHECKING`` (a type-only import still ties two modules).
``docs/architecture.md`` draws the same order.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lifecycle", "kv", "scheduler")

#: The rooms of ``scheduler/``, lowest first: a room imports rooms of lower levels only (and
#: itself). ``kv`` and ``lifecycle`` sit below all of them.
SCHEDULER_LEVELS: tuple[tuple[str, ...], ...] = (
    ("scheduler.messages", "scheduler.runner", "scheduler.stepping", "scheduler.malloc_arena"),
    ("scheduler.model", "scheduler.dist", "scheduler.sample"),
    ("scheduler.prefill", "scheduler.decode"),
    ("scheduler.assemble",),
    ("scheduler.embedded",),
    ("scheduler.service", "scheduler.demo", "scheduler.testing"),
    ("scheduler.cli",),
)
#: What no module of a package may import (a prefix matches the module and its children).
FORBIDDEN = {
    "lifecycle": ("torch", "kv", "scheduler", "socket", "threading", "zmq"),
    "kv": ("scheduler",),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }


def _imports(name: str, path: Path) -> Iterator[str]:
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield module
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
            yield from (f"{module}.{alias.name}" for alias in node.names)


MODULES = _modules()
GRAPH = {
    name: sorted({imp for imp in _imports(name, path) if imp in MODULES and imp != name})
    for name, path in MODULES.items()
}
ALL_IMPORTS = {name: sorted(set(_imports(name, path))) for name, path in MODULES.items()}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _level(module: str) -> tuple[int, str] | None:
    for level, rooms in enumerate(SCHEDULER_LEVELS):
        for room in rooms:
            if _under(module, room):
                return level, room
    return None


def test_every_scheduler_module_has_a_room() -> None:
    homeless = [m for m in MODULES if _under(m, "scheduler") and m != "scheduler"
                and _level(m) is None]
    assert homeless == [], f"add these to SCHEDULER_LEVELS (and docs/architecture.md): {homeless}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downward(package: str) -> None:
    bad = [
        f"{mod} imports {imp}"
        for mod, imports in ALL_IMPORTS.items() if _under(mod, package)
        for imp in imports
        if any(_under(imp, banned) for banned in FORBIDDEN[package])
    ]
    assert bad == []


def test_rooms_import_only_rooms_below() -> None:
    bad = []
    for mod, imports in GRAPH.items():
        here = _level(mod)
        if here is None:
            continue
        for imp in imports:
            there = _level(imp)
            if there is None or there[1] == here[1]:
                continue
            if there[0] >= here[0]:
                bad.append(f"{mod} (level {here[0]}) imports {imp} (level {there[0]})")
    assert bad == []


def _cycle_from(start: str) -> list[str] | None:
    """A shortest import circle through ``start``, or None."""
    frontier: list[list[str]] = [[start]]
    seen = {start}
    while frontier:
        nxt = []
        for path in frontier:
            for imp in GRAPH[path[-1]]:
                if imp == start:
                    return [*path, start]
                if imp not in seen:
                    seen.add(imp)
                    nxt.append([*path, imp])
        frontier = nxt
    return None


def test_no_import_circles() -> None:
    circles = {" -> ".join(c) for mod in GRAPH if (c := _cycle_from(mod)) is not None}
    assert sorted(circles) == []


def test_the_check_sees_a_circle() -> None:
    """The circle search itself, on a made-up graph: it must find what it is meant to find."""
    saved = dict(GRAPH)
    try:
        GRAPH.clear()
        GRAPH.update({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]})
        assert _cycle_from("a") == ["a", "b", "c", "a"]
        assert _cycle_from("d") is None
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
