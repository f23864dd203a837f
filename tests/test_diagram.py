"""Diagrams generated from the tables: every edge drawn, deterministic, SVG through Graphviz."""

from __future__ import annotations

import enum
import itertools
import re

import attrs
import pytest

from lifecycle import DECODE_TABLE, PREFILL_TABLE, Edge, LifecycleTable, make_table
from lifecycle.diagram import (
    DiagramError,
    dot,
    markdown,
    mermaid,
    render,
    svg,
    sync_docs,
    transition_table,
)

TABLES = [PREFILL_TABLE, DECODE_TABLE]


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_mermaid_draws_every_edge_the_initial_and_the_finals(table: LifecycleTable) -> None:
    text = mermaid(table)
    assert text.startswith(f"---\ntitle: {table.name} lifecycle\n---\nstateDiagram-v2\n")
    arrows = {
        (src, dst): label.split(" | ")
        for src, dst, label in re.findall(r"^  (\w+) --> (\w+): (.+)$", text, re.MULTILINE)
    }
    for e in table.edges:
        labels = arrows[(e.source.name, e.dest.name)]
        assert any(label.split(" [")[0] == e.event for label in labels), e
    assert f"  [*] --> {table.initial.name}\n" in text
    for final in table.finals:
        assert f"  {final.name} --> [*]\n" in text
    assert "s_active\n" not in text.replace("classDef s_active", "")  # no state styled active
    assert mermaid(table) == text


def test_mermaid_shows_guards() -> None:
    text = mermaid(PREFILL_TABLE)
    assert "FORWARD --> FORWARD: chunk_done [!fully_computed]" in text
    assert "FORWARD --> TRANSFERRING: prefilled [fully_computed]" in text


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_markdown_has_one_row_per_edge_in_table_order(table: LifecycleTable) -> None:
    rows = transition_table(table).splitlines()[2:]
    assert len(rows) == len(table.edges)
    for row, e in zip(rows, table.edges, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:3] == [f"`{e.event}`", e.source.name, e.dest.name]
        assert cells[5] == e.doc


def test_prefill_markdown_has_guards_hooks_and_the_resources_table() -> None:
    text = markdown(PREFILL_TABLE)
    assert "| `chunk_done` | FORWARD | FORWARD | `not fully_computed` | — |" in text
    assert "| `transferred` | TRANSFERRING | DONE | — | `release`, `respond` |" in text
    assert "### prefill: resources by state" in text
    assert "| WAITING | held | held | — |" in text
    assert "resources by state" not in markdown(DECODE_TABLE)


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_dot_and_svg(table: LifecycleTable) -> None:
    source = dot(table)
    assert source.startswith(f"digraph {table.name} {{")
    for e in table.edges:
        # A self-loop is drawn on the node's lower side (its label clear of the edge in).
        loop = e.source is e.dest
        port = ":s" if loop else ""
        assert f"{e.source.name}{port} -> {e.dest.name}{port}" in source
    for final in table.finals:
        assert f"{final.name} [peripheries=2]" in source
    assert f"__start -> {table.initial.name}" in source
    image = svg(table)
    assert image.lstrip().startswith(("<?xml", "<svg"))
    assert "<svg" in image and "BOOTSTRAPPING" in image


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_collapsed_failures_draw_each_failure_event_once(table: LifecycleTable) -> None:
    text = mermaid(table, collapse_failures=True)
    progress = [e for e in table.edges if e.event not in table.failure_events]
    # The progress edges, one edge for both failure events, the start and the two finals.
    assert text.count("-->") == len(progress) + 1 + 1 + len(table.finals)
    assert 'state "any live state" as ANY_LIVE' in text
    assert "ANY_LIVE --> FAILED: fail | abort" in text
    assert "BOOTSTRAPPING --> FAILED" not in text
    source = dot(table, collapse_failures=True)
    assert 'ANY_LIVE [label="any live state" style="dashed,rounded"]' in source
    assert "ANY_LIVE -> FAILED" in source and "WAITING -> FAILED" not in source
    rows = markdown(table, collapse_failures=True)
    assert "| `fail` | any live state | FAILED |" in rows
    assert rows.count("| `abort` |") == 1
    assert mermaid(table, collapse_failures=False) == mermaid(table)


def test_mermaid_declares_only_the_classes_it_uses() -> None:
    lines = mermaid(PREFILL_TABLE).splitlines()
    declared = [line.split()[1] for line in lines if line.strip().startswith("classDef ")]
    used = {line.split()[2] for line in lines if line.strip().startswith("class ")}
    assert declared == ["s_default"] and used == {"s_default"}


def test_the_prefill_self_loop_label_is_clear_of_schedule() -> None:
    # The chunk_done loop is drawn under FORWARD, schedule comes in from the upper left.
    source = dot(PREFILL_TABLE)
    assert "FORWARD:s -> FORWARD:s [label=" in source
    assert "WAITING -> FORWARD [label=schedule]" in source


def test_svg_without_graphviz_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(DiagramError, match="apt-get install graphviz"):
        svg(PREFILL_TABLE)


def test_render_dispatches_and_rejects_unknown_formats() -> None:
    assert render(PREFILL_TABLE, "md") == markdown(PREFILL_TABLE)
    assert render(PREFILL_TABLE, "mermaid") == mermaid(PREFILL_TABLE)
    with pytest.raises(DiagramError, match="unknown diagram format 'png'"):
        render(PREFILL_TABLE, "png")


def test_sync_docs_fills_blocks_and_rejects_unknown_or_missing_ones() -> None:
    tables = {"prefill": PREFILL_TABLE, "decode": DECODE_TABLE}
    names = ["prefill-mermaid", "prefill-transitions", "decode-mermaid", "decode-transitions"]
    doc = "".join(
        f"intro\n<!-- BEGIN GENERATED: {n} -->\nstale\n<!-- END GENERATED: {n} -->\n"
        for n in names
    )
    fresh = sync_docs(doc, tables)  # a user's document: its tables' blocks only
    assert "stale" not in fresh and "```mermaid\n---\ntitle: prefill" in fresh
    assert sync_docs(fresh, tables) == fresh
    extra = doc + "<!-- BEGIN GENERATED: notes -->\nstale\n<!-- END GENERATED: notes -->\n"
    assert sync_docs(extra, tables, {"notes": "fresh\n"}).endswith(
        "<!-- BEGIN GENERATED: notes -->\nfresh\n<!-- END GENERATED: notes -->\n")
    with pytest.raises(DiagramError, match="no generated block for \\['decode-transitions'\\]"):
        sync_docs(doc.split("intro\n<!-- BEGIN GENERATED: decode-transitions")[0], tables)
    bogus = fresh + "<!-- BEGIN GENERATED: nope -->\n<!-- END GENERATED: nope -->\n"
    with pytest.raises(DiagramError, match="unknown generated block 'nope'"):
        sync_docs(bogus, tables)


def _table_with_state_names(*names: str, doc: str = "") -> LifecycleTable:
    """A table whose live states, between START and DONE, have the given names."""
    states = enum.IntEnum(  # type: ignore[misc]
        "Odd", {"DONE": 0, "START": 1} | {n: i for i, n in enumerate(names, 2)})
    ids = [states[n] for n in names]
    hops = [states.START, *ids, states.DONE]
    return make_table(
        "odd", states, initial=states.START, finals=(states.DONE,),
        edges=[Edge(f"go{i}", a, b, doc=doc) for i, (a, b) in enumerate(itertools.pairwise(hops))],
    )


def test_mermaid_draws_names_it_cannot_read_as_ids_under_ids_of_ours() -> None:
    odd = ["HALF-DONE", "class", "note", "ÉCHEC", "Default_x", 'say "hi"', "s2", "ANY_LIVE"]
    table = _table_with_state_names(*odd)
    text = mermaid(table, collapse_failures=True)
    declared = dict(re.findall(r'^  state "([^"]*)" as (.*)$', text, re.MULTILINE))
    assert set(declared) == {s.name.replace('"', "#quot;") for s in table.states}
    ids = list(declared.values())
    assert len(set(ids)) == len(ids)
    for made in ids:  # mermaid's id grammar, and none of its keywords
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", made), made
        assert made.lower() not in {"class", "note", "state"} and not made.lower().startswith(
            "default")
    # Every line that names a state names it by its id.
    for src, dst in re.findall(r"^  (\S+) --> (\S+?)(?::|$)", text, re.MULTILINE):
        assert {src, dst} - {"[*]"} <= set(ids), (src, dst)
    for used in re.findall(r"^  class (\S+) ", text, re.MULTILINE):
        assert used in ids
    assert declared["HALF-DONE"] == "s2_" and declared["s2"] == "s2"  # ours never clash
    assert declared["START"] == "START" and declared["DONE"] == "DONE"  # readable ones kept


def test_markdown_cells_escape_pipes_and_newlines() -> None:
    table = _table_with_state_names("A|B", doc="a | pipe\nand a line")
    rows = transition_table(table).splitlines()[2:]
    assert rows[0] == r"| `go0` | START | A\|B | — | — | a \| pipe and a line |"
    for row in rows:
        assert len(re.split(r"(?<!\\)\|", row)) == 8  # six cells, no more


def test_sync_docs_fills_the_blocks_of_a_table_whose_name_has_a_dot() -> None:
    table = _table_with_state_names("MIDDLE")
    dotted = attrs.evolve(table, name="ingest.v2")
    doc = "".join(f"<!-- BEGIN GENERATED: ingest.v2-{kind} -->\nstale\n"
                  f"<!-- END GENERATED: ingest.v2-{kind} -->\n"
                  for kind in ("mermaid", "transitions"))
    fresh = sync_docs(doc, {"ingest.v2": dotted})
    assert "stale" not in fresh and "title: ingest.v2 lifecycle" in fresh


class Twice(enum.IntEnum):
    FAILED = 0
    A = 1
    B = 2
    C = 3
    DONE = 4


def _failing_from(*sources: Twice, cancelled_from: tuple[Twice, ...] = ()) -> LifecycleTable:
    """A → B → C → DONE, with a fail and a drop edge from each of ``sources`` in that order
    (after the others), the drop edges from ``cancelled_from`` also running ``log``."""
    return make_table(
        "twice", Twice, initial=Twice.A, finals=(Twice.DONE, Twice.FAILED),
        edges=(Edge("go", Twice.A, Twice.B), Edge("on", Twice.B, Twice.C),
               Edge("finish", Twice.C, Twice.DONE),
               *(Edge("fail", s, Twice.FAILED) for s in sources),
               *(Edge("drop", s, Twice.FAILED, after="log") for s in cancelled_from),
               *(Edge("drop", s, Twice.FAILED) for s in sources if s not in cancelled_from)),
        failure_events=("fail", "drop"), on_enter={Twice.FAILED: "release"})


def test_collapsed_markdown_compares_sources_as_a_set() -> None:
    """Failure edges listed in another order than the states still leave every live state;
    a group that leaves some lists them in state order."""
    rows = transition_table(_failing_from(Twice.C, Twice.A, Twice.B, cancelled_from=(
        Twice.C, Twice.A)), collapse_failures=True)
    assert "| `fail` | any live state | FAILED | — | `release` |  |" in rows
    assert "| `drop` | A, C | FAILED | — | `log`, `release` |  |" in rows
    assert "| `drop` | B | FAILED | — | `release` |  |" in rows


def test_collapsed_dot_keeps_a_state_named_like_its_own_nodes_apart() -> None:
    """A state named ANY_LIVE (or __start) is drawn as itself, not merged into the node that
    stands for every live state (or the start point)."""
    states = enum.IntEnum("Named", {"FAILED": 0, "NEW": 1, "ANY_LIVE": 2,  # type: ignore[misc]
                                    "__start": 3, "DONE": 4})
    table = make_table(
        "named", states, initial=states.NEW, finals=(states.DONE, states.FAILED),
        edges=(Edge("start", states.NEW, states.ANY_LIVE),
               Edge("next", states.ANY_LIVE, states["__start"]),
               Edge("finish", states["__start"], states.DONE),
               *(Edge("fail", s, states.FAILED) for s in (states.NEW, states.ANY_LIVE,
                                                          states["__start"]))),
        failure_events=("fail",))
    source = dot(table, collapse_failures=True)
    assert "\tNEW -> ANY_LIVE [label=start]" in source
    assert "\tANY_LIVE -> __start [label=next]" in source
    assert '\tANY_LIVE_ [label="any live state" style="dashed,rounded"]' in source
    assert "\tANY_LIVE_ -> FAILED [label=fail]" in source
    assert "\tANY_LIVE -> FAILED" not in source
    assert '\t__start_ [label="" shape=point width=0.15]' in source
    assert "\t__start_ -> NEW" in source
    text = mermaid(table, collapse_failures=True)
    assert 'state "ANY_LIVE" as s2' in text and 'state "any live state" as ANY_LIVE' in text
