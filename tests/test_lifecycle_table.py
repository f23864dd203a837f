"""Lifecycle tables: each definition rule, broken by a small table, raises InvalidTable naming
the offending state or edge; the shipped tables are valid."""

from __future__ import annotations

import enum
from typing import Any

import attrs
import pytest

from lifecycle import (
    DECODE_TABLE,
    PREFILL_TABLE,
    Edge,
    InvalidTable,
    LifecycleTable,
    make_table,
    validate,
)


class S(enum.IntEnum):
    FAILED = 0
    START = 1
    MIDDLE = 2
    DONE = 3


class Other(enum.IntEnum):
    ELSEWHERE = 7


GOOD_EDGES = (
    Edge("go", S.START, S.MIDDLE),
    Edge("finish", S.MIDDLE, S.DONE),
    Edge("fail", S.START, S.FAILED),
    Edge("fail", S.MIDDLE, S.FAILED),
)


def build(**overrides: Any) -> LifecycleTable:
    kwargs: dict[str, Any] = {
        "initial": S.START,
        "finals": (S.DONE, S.FAILED),
        "edges": GOOD_EDGES,
        "failure_events": ("fail",),
    }
    kwargs.update(overrides)
    return make_table("toy", S, **kwargs)


def test_a_good_table_builds_with_derived_lookups() -> None:
    table = build()
    assert table.initial is S.START
    assert table.live_states() == (S.START, S.MIDDLE)
    assert table.events == ("go", "finish", "fail")
    assert table.edge(S.START, "go") == GOOD_EDGES[0]
    assert table.edge(S.DONE, "go") is None
    assert table.is_final(S.FAILED) and not table.is_final(S.MIDDLE)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"initial": Other.ELSEWHERE}, "initial state <Other.ELSEWHERE: 7> is not a state",
            id="initial-not-a-state",
        ),
        pytest.param({"initial": S.DONE}, "initial state DONE is final", id="initial-final"),
        pytest.param({"finals": ()}, "no final state", id="no-final"),
        pytest.param(
            {"edges": (*GOOD_EDGES, Edge("revive", S.DONE, S.START))},
            "edge 'revive' leaves final state DONE",
            id="edge-out-of-final",
        ),
        pytest.param(
            {"edges": (Edge("finish", S.START, S.DONE), Edge("fail", S.START, S.FAILED)),
             "failure_events": ()},
            "state MIDDLE is unreachable from START",
            id="unreachable",
        ),
        pytest.param(
            {"edges": (Edge("go", S.START, S.MIDDLE), Edge("fail", S.START, S.FAILED),
                       Edge("finish", S.START, S.DONE), Edge("spin", S.MIDDLE, S.MIDDLE)),
             "failure_events": ()},
            "state MIDDLE cannot reach a final state (a trap)",
            id="trap",
        ),
        pytest.param(
            {"edges": GOOD_EDGES[:3]},
            "failure event 'fail' is not legal from state MIDDLE",
            id="failure-event-missing",
        ),
        pytest.param(
            {"edges": (*GOOD_EDGES[:3], Edge("fail", S.MIDDLE, S.START))},
            "failure event 'fail' from MIDDLE leads to non-final START",
            id="failure-event-not-final",
        ),
        pytest.param(
            {"edges": (*GOOD_EDGES[:3], Edge("fail", S.MIDDLE, S.FAILED, conditions=("ok",)))},
            "failure event 'fail' from MIDDLE is guarded",
            id="failure-event-guarded",
        ),
        pytest.param(
            {"edges": (*GOOD_EDGES, Edge("go", S.START, S.FAILED))},
            "two edges for event 'go' from state START",
            id="duplicate-edge",
        ),
        pytest.param(
            {"edges": (*GOOD_EDGES, Edge("stray", S.MIDDLE, Other.ELSEWHERE))},  # type: ignore[arg-type]
            "edge 'stray' names <Other.ELSEWHERE: 7>, not a S",
            id="edge-to-foreign-state",
        ),
        pytest.param(
            {"on_enter": {Other.ELSEWHERE: ("release",)}},
            "on_enter names <Other.ELSEWHERE: 7>, not a state",
            id="on-enter-foreign-state",
        ),
        pytest.param(
            {"on_enter": {S.START: ("release",)}},
            "on_enter hooks on the initial state START: admission runs no hooks, so they would "
            "not run for a request's start",
            id="on-enter-initial-state",
        ),
        pytest.param(  # a retry loop back into the start: where its hooks go instead
            {"edges": (*GOOD_EDGES, Edge("retry", S.MIDDLE, S.START)),
             "on_enter": {S.START: ("release",)}},
            "for the edges back into it, put them in after= on 'retry'",
            id="on-enter-initial-state-with-a-way-back",
        ),
        # States given by name, right or misspelt, say what to write instead.
        pytest.param({"finals": ("DONE", S.FAILED)},
                     "finals names 'DONE', not a S (give the member S.DONE, not its name)",
                     id="final-by-name"),
        pytest.param({"finals": ("DONNE", S.FAILED)},
                     "finals names 'DONNE', not a S (did you mean 'DONE'?)", id="final-misspelt"),
        pytest.param({"initial": "START"}, "(give the member S.START, not its name)",
                     id="initial-by-name"),
        pytest.param({"edges": (*GOOD_EDGES, Edge("stray", S.MIDDLE, "MIDLE"))},  # type: ignore[arg-type]
                     "edge 'stray' names 'MIDLE', not a S (did you mean 'MIDDLE'?)",
                     id="edge-state-misspelt"),
        pytest.param({"failure_events": ("fial",)},
                     "failure event 'fial' is not an event of the table (did you mean 'fail'?)",
                     id="failure-event-misspelt"),
        pytest.param({"edges": (*GOOD_EDGES[:1], Edge("finish", S.MIDDLE, S.DONE,
                                                       conditions="ok", unless=("ok",)),
                                *GOOD_EDGES[2:])},
                     "edge 'finish' from MIDDLE has guard 'ok' in both conditions and unless",
                     id="dead-edge"),
    ],
)
def test_each_broken_rule_raises_naming_the_state_or_edge(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidTable) as info:
        build(**overrides)
    text = str(info.value)
    assert text.startswith("toy: ") and message in text, text


def test_every_broken_rule_is_named_at_once() -> None:
    """Independent broken rules are each named, one line each: removing the only edge into a
    state leaves an event no edge takes, unreachable states and a failure event missing from
    one, all said by the one error."""

    class Ev(enum.StrEnum):
        GO = "go"
        FINISH = "finish"
        FAIL = "fail"

    edges = (Edge("finish", S.MIDDLE, S.DONE), Edge("fail", S.START, S.FAILED))
    with pytest.raises(InvalidTable) as info:
        build(edges=edges, events=Ev)
    assert str(info.value).splitlines() == [
        "toy: Ev has events no edge takes: ['go']",
        "toy: state MIDDLE is unreachable from START",
        "toy: state DONE is unreachable from START",
        "toy: failure event 'fail' is not legal from state MIDDLE",
    ]


def test_a_rule_the_others_depend_on_is_named_alone() -> None:
    # The graph cannot be walked from an initial state that is not a state.
    with pytest.raises(InvalidTable) as info:
        build(initial=Other.ELSEWHERE, edges=GOOD_EDGES[:3])
    assert str(info.value).splitlines() == [
        "toy: the initial state <Other.ELSEWHERE: 7> is not a state"]


class Ev(enum.StrEnum):
    GO = "go"
    FINISH = "finish"
    FAIL = "fail"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"name": "my table"}, "table name 'my table' is not usable", id="name"),
        pytest.param({"initial": Other.ELSEWHERE, "edges": GOOD_EDGES[:3]},
                     "toy: the initial state <Other.ELSEWHERE: 7> is not a state",
                     id="initial-not-a-state"),
        # Before: each failure event also "not legal from states FAILED, DONE" and "from
        # START leads to non-final FAILED", the opposite of the fix.
        pytest.param({"finals": ()}, "toy: no final state", id="no-final"),
        # Before: every other state also "unreachable from DONE", and DONE's hooks "on the
        # initial state".
        pytest.param({"initial": S.DONE, "on_enter": {S.DONE: ("release",)}},
                     "toy: the initial state DONE is final", id="initial-final"),
        pytest.param({"finals": (S.DONE, "FAILD")}, "toy: finals names 'FAILD', not a S",
                     id="final-not-a-state"),
        pytest.param({"edges": (*GOOD_EDGES[:3], Edge("stray", S.MIDDLE, Other.ELSEWHERE))},  # type: ignore[arg-type]
                     "toy: edge 'stray' names <Other.ELSEWHERE: 7>, not a S",
                     id="edge-state"),
        pytest.param({"edges": (*GOOD_EDGES[:3], Edge("stray", S.MIDDLE, S.DONE)),
                      "events": Ev},
                     "toy: edge event 'stray' is not a member of Ev", id="edge-event"),
        pytest.param({"edges": (*GOOD_EDGES[:3], Edge("fire", S.MIDDLE, S.DONE))},
                     "toy: event 'fire' is a name every record uses", id="edge-event-name"),
    ],
)
@pytest.mark.parametrize("path", ["make_table", "validate"])
def test_a_rule_the_others_are_checked_from_is_named_alone(
    overrides: dict[str, Any], message: str, path: str
) -> None:
    """Docs/framework.md section 3: the name, the initial and final states, the edges' states
    and events are each reported alone, by make_table and by validate (what `pdlife validate
    --load` runs) on a table not built by make_table. Each table here breaks other rules too
    (failure events, reachability, MIDDLE's missing failure edge): none of them is named."""
    changes = dict(overrides)
    events = changes.pop("events", None)
    with pytest.raises(InvalidTable) as info:
        if path == "make_table":
            name = changes.pop("name", "toy")
            make_table(name, S, **{"initial": S.START, "finals": (S.DONE, S.FAILED),
                                   "edges": GOOD_EDGES, "failure_events": ("fail",),
                                   "events": events, **changes})
        else:  # a table built around make_table (attrs.evolve), as `pdlife validate` loads it
            if "finals" in changes:
                changes["finals"] = frozenset(changes["finals"])
            validate(attrs.evolve(build(events=events), **changes))
    assert str(info.value).splitlines()[0].startswith(message), str(info.value)
    assert len(str(info.value).splitlines()) == 1, str(info.value)


def test_validate_rechecks_a_table_built_around_make_table() -> None:
    # validate() is what `pdlife validate` runs; it must catch a table assembled by hand.
    good = build()
    broken = LifecycleTable(
        name="handmade",
        states=S,
        initial=S.START,
        finals=frozenset({S.DONE, S.FAILED}),
        edges=good.edges[:3],
        failure_events=("fail",),
        on_enter={},
        lookup={(e.source, e.event): e for e in good.edges[:3]},
        events=good.events,
    )
    with pytest.raises(InvalidTable, match="'fail' is not legal from state MIDDLE"):
        validate(broken)


@pytest.mark.parametrize("table", [PREFILL_TABLE, DECODE_TABLE], ids=lambda t: t.name)
def test_the_shipped_tables_are_valid_and_fully_failable(table: LifecycleTable) -> None:
    validate(table)
    for state in table.live_states():
        for event in ("fail", "abort"):
            edge = table.edge(state, event)
            assert edge is not None and edge.dest in table.finals
    assert table.hooks() == {"release", "respond"}


@pytest.mark.parametrize("given", [{"conditions": lambda r: True}, {"after": print},
                                   {"unless": ["ok", len]}])
def test_an_edge_names_its_guards_and_hooks(given: dict[str, Any]) -> None:
    """A callable where a name goes (as ``transitions`` takes them) says the rule."""
    with pytest.raises(TypeError, match=r"an Edge names its guards and hooks, got .*Lifecycle"):
        Edge("go", S.START, S.MIDDLE, **given)


@pytest.mark.parametrize("name", ["", "my ingest/v2", ".hidden", "-x", "a b", "ingest\n", None])
def test_a_table_name_must_name_a_file_and_a_docs_marker(name: Any) -> None:
    with pytest.raises(InvalidTable, match=r"^table name .* is not usable: .*"
                       r"ASCII letters, digits, '_', '-' and '.', starting with"):
        make_table(name, S, initial=S.START, finals=(S.DONE, S.FAILED), edges=GOOD_EDGES)
    handmade = attrs.evolve(build(), name=name)
    with pytest.raises(InvalidTable, match=r"^table name"):
        validate(handmade)


@pytest.mark.parametrize("name", ["ingest.v2", "my-ingest_2", "_x", "2fa"])
def test_table_names_of_letters_digits_dots_dashes_and_underscores_build(name: str) -> None:
    assert make_table(name, S, initial=S.START, finals=(S.DONE, S.FAILED),
                      edges=GOOD_EDGES).name == name


# -- once: the hooks that must run exactly once per request ---------------------------------


def test_once_defaults_to_the_hooks_entering_every_final_state_runs() -> None:
    """Not the union of the final states' hooks: a hook only FAILED runs (log_failure) is not
    run once by a request that ends in DONE. An after= hook of every edge into every final
    state is run on entering each, so it is one."""
    table = build(on_enter={S.DONE: ("respond",), S.FAILED: ("respond", "log_failure")})
    assert table.once == {"respond"}
    cleanup = build(edges=tuple(
        attrs.evolve(e, after=("cleanup",)) if e.dest in (S.DONE, S.FAILED) else e
        for e in GOOD_EDGES), on_enter={S.FAILED: ("log_failure",)})
    assert cleanup.once == {"cleanup"}
    assert build().once == frozenset()


def test_a_once_hook_some_way_to_a_final_state_never_runs_is_refused() -> None:
    with pytest.raises(InvalidTable) as info:
        build(on_enter={S.DONE: ("respond",), S.FAILED: ("respond", "log_failure")},
              once=("respond", "log_failure"))
    assert str(info.value) == (
        "toy: once hook 'log_failure' does not run on every way to a final state: a request "
        "that takes go, finish ends in DONE without it (a once hook runs exactly once per "
        "request: run it on that way too, or leave it out of once)")
    # An after= hook of the edge into DONE runs on that way: accepted.
    with_after = tuple(attrs.evolve(e, after=("log_failure",)) if e.event == "finish" else e
                       for e in GOOD_EDGES)
    build(edges=with_after, on_enter={S.FAILED: ("log_failure",)}, once=("log_failure",))


def test_a_once_hook_run_on_the_way_before_the_end_is_accepted() -> None:
    """A hook run on every way out of the initial state (go, or a failure from there) runs
    once on every way to a final state, though no final state's entering runs it."""
    edges = tuple(attrs.evolve(e, after=("acquire",)) if e.source is S.START else e
                  for e in GOOD_EDGES)
    assert build(edges=edges, once=("acquire",)).once == {"acquire"}
    # Not on the failure from START: that way never runs it.
    no_fail = tuple(attrs.evolve(e, after=("acquire",)) if e.event == "go" else e
                    for e in GOOD_EDGES)
    with pytest.raises(InvalidTable, match="a request that takes fail ends in FAILED without"):
        build(edges=no_fail, once=("acquire",))
