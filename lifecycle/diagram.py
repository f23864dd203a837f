"""Lifecycle diagrams generated from the tables: mermaid, Graphviz (dot, SVG) and markdown.

The graphs come from ``transitions``' ``GraphMachine`` built from the same table as the live
machine. They are built offline (docs, CLI, tests), never in the hot path: a GraphMachine
restyles a per-model graph on every transition. Two things of GraphMachine are worked around
here, in one place:

* ``get_graph`` needs a model (``get_combined_graph`` with ``model=None`` raises IndexError),
  and a model's graph styles its current state as "active". We build the graph object directly
  from the machine's ``graph_cls``, so no state is styled.
* Its mermaid title is emitted as bare front matter; we emit ``title: <name>``, and mark the
  final states (``STATE --> [*]``), which it does not.

Output is deterministic (states in enum order, edges in table order) so that the docs, which
embed it, can be compared with a fresh render (``pdlife diagram --write-docs``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from lifecycle.errors import LifecycleError
from lifecycle.invariants import PREFILL_RESOURCES
from lifecycle.prefill import PREFILL_TABLE
from lifecycle.table import LifecycleTable

FORMATS = ("mermaid", "dot", "svg", "md")


class DiagramError(LifecycleError):
    """A diagram could not be rendered (e.g. Graphviz is not installed)."""


def _graph(table: LifecycleTable, engine: Literal["graphviz", "mermaid"]) -> Any:
    # Imported here: diagram generation is an offline tool, and GraphMachine pulls in
    # the diagram backends.
    from transitions.extensions import GraphMachine

    machine = GraphMachine(
        model=None,
        states=[s.name for s in table.states],
        transitions=[
            {
                "trigger": e.event,
                "source": e.source.name,
                "dest": e.dest.name,
                "conditions": list(e.conditions),
                "unless": list(e.unless),
            }
            for e in table.edges
        ],
        initial=table.initial.name,
        auto_transitions=False,
        show_conditions=True,
        graph_engine=engine,
        title=table.name,
    )
    return machine.graph_cls(machine).get_graph(title=table.name)


def _finals(table: LifecycleTable) -> list[str]:
    return [s.name for s in table.states if s in table.finals]


def mermaid(table: LifecycleTable) -> str:
    """A mermaid ``stateDiagram-v2`` of ``table``."""
    lines = str(_graph(table, "mermaid").draw(None)).splitlines()
    if lines[:3] == ["---", table.name, "---"]:
        lines[1] = f"title: {table.name} lifecycle"
    lines += [f"  {name} --> [*]" for name in _finals(table)]
    # Mermaid spells the styling statement `class`.
    lines = [re.sub(r"^(\s*)Class ", r"\1class ", line) for line in lines]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _digraph(table: LifecycleTable) -> Any:
    graph = _graph(table, "graphviz")
    for name in _finals(table):
        graph.node(name, peripheries="2")
    graph.node("__start", label="", shape="point", width="0.15")
    graph.edge("__start", table.initial.name)
    return graph


def dot(table: LifecycleTable) -> str:
    """Graphviz source of ``table`` (final states drawn with a double border)."""
    return str(_digraph(table).source)


def svg(table: LifecycleTable) -> str:
    """An SVG of ``table``, rendered by Graphviz's ``dot`` program."""
    try:
        import graphviz
    except ImportError as exc:  # pragma: no cover - a dependency of the diagrams extra
        raise DiagramError(
            "SVG output needs the 'graphviz' Python package: pip install 'pdlife[diagrams]'"
        ) from exc
    try:
        return str(_digraph(table).pipe(format="svg", encoding="utf-8"))
    except graphviz.ExecutableNotFound as exc:
        raise DiagramError(
            "SVG output needs Graphviz's 'dot' program on PATH "
            "(Debian/Ubuntu: apt-get install graphviz); the mermaid, dot and md formats do not"
        ) from exc


def _cell(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) or "—"


def transition_table(table: LifecycleTable) -> str:
    """The transitions of ``table`` as a markdown table: one row per edge, in table order."""
    rows = [
        "| event | from | to | guards | hooks | when |",
        "|---|---|---|---|---|---|",
    ]
    for e in table.edges:
        guards = [*e.conditions, *(f"not {g}" for g in e.unless)]
        hooks = [*e.after, *table.on_enter.get(e.dest, ())]
        rows.append(
            f"| `{e.event}` | {e.source.name} | {e.dest.name} | {_cell(guards)} "
            f"| {_cell(hooks)} | {e.doc} |"
        )
    return "\n".join(rows) + "\n"


def resources_table() -> str:
    """The prefill ownership table (resources held by state) as markdown."""
    rows = ["| state | sender | metadata slot | KV pages | note |", "|---|---|---|---|---|"]
    for state, h in PREFILL_RESOURCES.items():
        cells = ["held" if held else "—" for held in (h.sender, h.slot, h.pages)]
        rows.append(f"| {state.name} | {' | '.join(cells)} | {h.note} |")
    return "\n".join(rows) + "\n"


def markdown(table: LifecycleTable) -> str:
    """The transition table of ``table``, and for the prefill table its ownership table."""
    text = f"### {table.name}: transitions\n\n{transition_table(table)}"
    if table is PREFILL_TABLE:
        text += f"\n### {table.name}: resources by state\n\n{resources_table()}"
    return text


def render(table: LifecycleTable, fmt: str) -> str:
    """``table`` in one of :data:`FORMATS`."""
    if fmt == "mermaid":
        return mermaid(table)
    if fmt == "dot":
        return dot(table)
    if fmt == "svg":
        return svg(table)
    if fmt == "md":
        return markdown(table)
    raise DiagramError(f"unknown diagram format {fmt!r}; choose one of {', '.join(FORMATS)}")


# -- docs -----------------------------------------------------------------------------------

_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n).*?(<!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)


def doc_blocks(tables: Mapping[str, LifecycleTable]) -> dict[str, str]:
    """The generated blocks of docs/lifecycle.md, by marker name."""
    blocks: dict[str, str] = {}
    for name, table in tables.items():
        blocks[f"{name}-mermaid"] = f"```mermaid\n{mermaid(table)}```\n"
        blocks[f"{name}-transitions"] = transition_table(table)
    blocks["prefill-resources"] = resources_table()
    return blocks


def sync_docs(text: str, tables: Mapping[str, LifecycleTable]) -> str:
    """``text`` with every ``<!-- BEGIN GENERATED: name -->`` … ``<!-- END GENERATED: name -->``
    block replaced by a fresh render. Every block of :func:`doc_blocks` must be there, and
    every marker must name one of them."""
    blocks = doc_blocks(tables)
    missing = sorted(set(blocks) - {m.group("name") for m in _BLOCK.finditer(text)})
    if missing:
        raise DiagramError(f"the document has no generated block for {missing}")

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in blocks:
            raise DiagramError(f"unknown generated block {name!r}; known: {sorted(blocks)}")
        return f"{m.group(1)}{blocks[name]}{m.group(3)}"

    return _BLOCK.sub(fill, text)
