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
* It writes a state's name as its mermaid id, and mermaid reads few names as ids: ASCII letters,
  digits and underscores, and not one of its keywords (``class``, ``note``, ...). A state whose
  name is not such an id is drawn under an id of ours (``s3``), with its name as the label
  (:func:`mermaid_ids`); pdlife's own states keep their names.

What is drawn: the states in enum order, final states marked; one arrow per pair of states
an edge joins, labelled with the events between them (their guards in brackets) joined by
`` | ``, the arrows in an order fixed by the table's edges; with ``collapse_failures``, each
failure event's edges replaced by one arrow per destination from a node standing for every
live state, whose id is one no state has (a state may be named ``ANY_LIVE``). The output is
deterministic, so that the docs, which embed it, can be compared with a fresh render
(``pdlife diagram --write-docs``).
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


#: The node that stands for every live state when failure edges are collapsed: its id where no
#: state has that name (mermaid draws such a state under an id of ours instead; dot, which
#: draws states under their names, gives the node another id: :func:`_unused`).
ANY_LIVE = "ANY_LIVE"
_ANY_LIVE_LABEL = "any live state"


# What mermaid's stateDiagram lexer reads as an id: anything else is drawn under an id of ours.
_MERMAID_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# Words its lexer takes at the start of a statement (case-insensitively); "default" is taken
# even as the start of a longer word.
_MERMAID_KEYWORDS = frozenset({
    "state", "note", "class", "classdef", "style", "scale", "direction", "click", "end",
    "as", "hide", "acctitle", "accdescr", "statediagram", "left", "right",
})


def _mermaid_safe(name: str) -> bool:
    folded = name.lower()
    return (bool(_MERMAID_ID.fullmatch(name)) and folded not in _MERMAID_KEYWORDS
            and not folded.startswith("default"))


def mermaid_ids(table: LifecycleTable) -> dict[str, str]:
    """The mermaid id of each state of ``table``, by name: the name itself where mermaid reads
    it as an id, else ``s<position>`` (made unique against the names kept)."""
    names = [s.name for s in table.states]
    # A state named like the collapsed failures' node is drawn under an id of ours as well.
    kept = {n for n in names if _mermaid_safe(n) and n != ANY_LIVE}
    taken = kept | {ANY_LIVE}
    ids: dict[str, str] = {}
    for position, name in enumerate(names):
        if name in kept:
            ids[name] = name
            continue
        made = f"s{position}"
        while made in taken:
            made += "_"
        taken.add(made)
        ids[name] = made
    return ids


def _unused(base: str, table: LifecycleTable) -> str:
    """``base``, or ``base`` followed by underscores: an id no state of ``table`` has."""
    names = {s.name for s in table.states}
    made = base
    while made in names:
        made += "_"
    return made


def _edges(
    table: LifecycleTable, collapse: bool, ids: Mapping[str, str], any_live: str
) -> list[dict[str, Any]]:
    """The transitions to draw: the table's edges, or with ``collapse`` its failure edges
    replaced by one edge per (failure event, destination) from ``any_live``."""
    out: list[dict[str, Any]] = []
    collapsed: dict[tuple[str, str], None] = {}
    for e in table.edges:
        if collapse and e.event in table.failure_events:
            collapsed[(str(e.event), ids[e.dest.name])] = None
            continue
        out.append({
            "trigger": str(e.event),
            "source": ids[e.source.name],
            "dest": ids[e.dest.name],
            "conditions": list(e.conditions),
            "unless": list(e.unless),
        })
    out += [{"trigger": ev, "source": any_live, "dest": dest} for ev, dest in collapsed]
    return out


def _graph(
    table: LifecycleTable, engine: Literal["graphviz", "mermaid"], collapse: bool = False
) -> Any:
    # Imported here: diagram generation is an offline tool, and GraphMachine pulls in
    # the diagram backends.
    from transitions.extensions import GraphMachine

    collapse = collapse and bool(table.failure_events)
    # Graphviz quotes any name itself; mermaid needs ids it can read.
    ids = mermaid_ids(table) if engine == "mermaid" else {s.name: s.name for s in table.states}
    any_live = _any_live(table, engine)
    machine = GraphMachine(
        model=None,
        states=[ids[s.name] for s in table.states] + ([any_live] if collapse else []),
        transitions=_edges(table, collapse, ids, any_live),
        initial=ids[table.initial.name],
        auto_transitions=False,
        show_conditions=True,
        graph_engine=engine,
        title=table.name,
    )
    for name, made in ids.items():
        if made != name:
            # transitions' markup shows a state's ``label`` attribute if it has one; the label
            # is quoted in mermaid, where a quote is written as its entity.
            state = machine.states[made]
            state.label = name.replace('"', "#quot;")  # type: ignore[attr-defined]
    return machine.graph_cls(machine).get_graph(title=table.name)


def _any_live(table: LifecycleTable, engine: str) -> str:
    """The id of the node standing for every live state: mermaid draws a state named
    :data:`ANY_LIVE` under an id of ours (:func:`mermaid_ids`), dot under its name."""
    return ANY_LIVE if engine == "mermaid" else _unused(ANY_LIVE, table)


def _finals(table: LifecycleTable) -> list[str]:
    return [s.name for s in table.states if s in table.finals]


def _used_classes_only(lines: list[str]) -> list[str]:
    # GraphMachine declares a class for every styling it knows; keep those a state uses.
    used = {m.group(1) for line in lines if (m := re.match(r"\s*class \S+ (\S+)$", line))}
    return [
        line for line in lines
        if not (m := re.match(r"\s*classDef (\S+) ", line)) or m.group(1) in used
    ]


def mermaid(table: LifecycleTable, *, collapse_failures: bool = False) -> str:
    """A mermaid ``stateDiagram-v2`` of ``table``; ``collapse_failures`` draws each failure
    event once, from a node standing for every live state."""
    lines = str(_graph(table, "mermaid", collapse_failures).draw(None)).splitlines()
    if lines[:3] == ["---", table.name, "---"]:
        lines[1] = f"title: {table.name} lifecycle"
    ids = mermaid_ids(table)
    lines += [f"  {ids[name]} --> [*]" for name in _finals(table)]
    # Mermaid spells the styling statement `class`.
    lines = [re.sub(r"^(\s*)Class ", r"\1class ", line) for line in lines]
    any_live = f'state "{ANY_LIVE}" as {ANY_LIVE}'
    lines = [
        line.replace(any_live, f'state "{_ANY_LIVE_LABEL}" as {ANY_LIVE}')
        for line in _used_classes_only(lines)
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _digraph(table: LifecycleTable, collapse: bool) -> Any:
    graph = _graph(table, "graphviz", collapse)
    # A self-loop drawn on the node's lower side, so its label does not sit on the label of
    # the edge coming in from above.
    graph.body = [re.sub(r"^\t(\w+) -> \1 \[", r"\t\1:s -> \1:s [", line) for line in graph.body]
    for name in _finals(table):
        graph.node(name, peripheries="2")
    if collapse and table.failure_events:
        graph.node(_any_live(table, "graphviz"), label=_ANY_LIVE_LABEL, style="dashed,rounded")
    start = _unused("__start", table)
    graph.node(start, label="", shape="point", width="0.15")
    graph.edge(start, table.initial.name)
    return graph


def dot(table: LifecycleTable, *, collapse_failures: bool = False) -> str:
    """Graphviz source of ``table`` (final states drawn with a double border)."""
    return str(_digraph(table, collapse_failures).source)


def svg(table: LifecycleTable, *, collapse_failures: bool = False) -> str:
    """An SVG of ``table``, rendered by Graphviz's ``dot`` program."""
    try:
        import graphviz
    except ImportError as exc:  # pragma: no cover - a dependency of the diagrams extra
        raise DiagramError(
            "SVG output needs the 'graphviz' Python package: pip install 'pdlife[diagrams]'"
        ) from exc
    try:
        graph = _digraph(table, collapse_failures)
        return str(graph.pipe(format="svg", encoding="utf-8"))
    except graphviz.ExecutableNotFound as exc:
        raise DiagramError(
            "SVG output needs Graphviz's 'dot' program on PATH "
            "(Debian/Ubuntu: apt-get install graphviz); the mermaid, dot and md formats do not"
        ) from exc


def _text(text: str) -> str:
    """``text`` as one markdown table cell: a ``|`` would end the cell, a newline the row."""
    return " ".join(text.replace("|", "\\|").splitlines())


def _cell(names: Iterable[str]) -> str:
    return ", ".join(f"`{_text(n)}`" for n in names) or "—"


def transition_table(table: LifecycleTable, *, collapse_failures: bool = False) -> str:
    """The transitions of ``table`` as a markdown table: one row per edge, in table order;
    with ``collapse_failures``, the edges of a failure event that agree on destination, hooks
    and doc share one row, where the first of them is: from "any live state" when they leave
    every live state, in whatever order the table lists them, else from their sources in
    state order."""
    rows = [
        "| event | from | to | guards | hooks | when |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, tuple[str, ...], str], list[str]] = {}
    for e in table.edges:
        if collapse_failures and e.event in table.failure_events:
            key = (str(e.event), e.dest.name, table.hooks_of(e), e.doc)
            groups.setdefault(key, []).append(e.source.name)
    live = {s.name for s in table.live_states()}
    for e in table.edges:
        guards = [*e.conditions, *(f"not {g}" for g in e.unless)]
        hooks = table.hooks_of(e)
        source = e.source.name
        if collapse_failures and e.event in table.failure_events:
            sources = groups.pop((str(e.event), e.dest.name, hooks, e.doc), None)
            if sources is None:
                continue  # already written with its group
            source = (_ANY_LIVE_LABEL if set(sources) == live
                      else ", ".join(s.name for s in table.states if s.name in sources))
        rows.append(
            f"| {_cell([str(e.event)])} | {_text(source)} | {_text(e.dest.name)} "
            f"| {_cell(guards)} | {_cell(hooks)} | {_text(e.doc)} |"
        )
    return "\n".join(rows) + "\n"


def resources_table() -> str:
    """The prefill ownership table (resources held by state) as markdown."""
    rows = ["| state | sender | metadata slot | KV pages | SWA pages, recurrent slot | note |",
            "|---|---|---|---|---|---|"]
    for state, h in PREFILL_RESOURCES.items():
        cells = ["held" if held else "—" for held in (h.sender, h.slot, h.pages, h.state)]
        rows.append(f"| {_text(state.name)} | {' | '.join(cells)} | {_text(h.note)} |")
    return "\n".join(rows) + "\n"


def markdown(table: LifecycleTable, *, collapse_failures: bool = False) -> str:
    """The transition table of ``table``, and for the prefill table its ownership table."""
    rows = transition_table(table, collapse_failures=collapse_failures)
    text = f"### {table.name}: transitions\n\n{rows}"
    if table is PREFILL_TABLE:
        text += f"\n### {table.name}: resources by state\n\n{resources_table()}"
    return text


def render(table: LifecycleTable, fmt: str, *, collapse_failures: bool = False) -> str:
    """``table`` in one of :data:`FORMATS`."""
    if fmt == "mermaid":
        return mermaid(table, collapse_failures=collapse_failures)
    if fmt == "dot":
        return dot(table, collapse_failures=collapse_failures)
    if fmt == "svg":
        return svg(table, collapse_failures=collapse_failures)
    if fmt == "md":
        return markdown(table, collapse_failures=collapse_failures)
    raise DiagramError(f"unknown diagram format {fmt!r}; choose one of {', '.join(FORMATS)}")


# -- docs -----------------------------------------------------------------------------------

_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w.-]+) -->\n).*?(<!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)


def doc_blocks(tables: Mapping[str, LifecycleTable],
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The generated blocks of a document, by marker name: ``<name>-mermaid`` and
    ``<name>-transitions`` for each of ``tables`` (by name), and the ``extra`` blocks as given
    (pdlife's docs/lifecycle.md adds ``prefill-resources``: :func:`pdlife_doc_extra`)."""
    blocks: dict[str, str] = {}
    for name, table in tables.items():
        blocks[f"{name}-mermaid"] = f"```mermaid\n{mermaid(table)}```\n"
        blocks[f"{name}-transitions"] = transition_table(table)
    blocks.update(extra or {})
    return blocks


def pdlife_doc_extra() -> dict[str, str]:
    """The blocks docs/lifecycle.md holds besides its tables' (the prefill ownership table)."""
    return {"prefill-resources": resources_table()}


def sync_docs(text: str, tables: Mapping[str, LifecycleTable],
              extra: Mapping[str, str] | None = None) -> str:
    """``text`` with every ``<!-- BEGIN GENERATED: name -->`` … ``<!-- END GENERATED: name -->``
    block replaced by a fresh render. Every block of :func:`doc_blocks` (``tables`` and
    ``extra``) must be there, and every marker must name one of them."""
    blocks = doc_blocks(tables, extra)
    missing = sorted(set(blocks) - {m.group("name") for m in _BLOCK.finditer(text)})
    if missing:
        first = missing[0]
        raise DiagramError(
            f"the document has no generated block for {missing}: put a pair of marker lines "
            f"where each goes, e.g. '<!-- BEGIN GENERATED: {first} -->' and "
            f"'<!-- END GENERATED: {first} -->', each on a line of its own")

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in blocks:
            raise DiagramError(f"unknown generated block {name!r}; known: {sorted(blocks)}")
        return f"{m.group(1)}{blocks[name]}{m.group(3)}"

    return _BLOCK.sub(fill, text)
