"""What the lifecycle refuses when it is used wrongly, and how it says so: failures in mixed
states all or none, the index's read-only views, reasons only on failure events, hooks that
cannot be called, reserved event names, copies of tracked records, and the messages of refused
batches and admissions."""

from __future__ import annotations

import copy
import enum
import re
import tomllib
from pathlib import Path
from typing import ClassVar

import attrs
import pytest

from lifecycle import (
    Edge,
    HookFailed,
    IllegalTransition,
    InvalidTable,
    Lifecycle,
    LifecycleError,
    MissingHook,
    Tracked,
    Trigger,
    make_table,
)


class S(enum.IntEnum):
    FAILED = 0
    QUEUED = 1
    RUNNING = 2
    SUCCEEDED = 3


class E(enum.StrEnum):
    START = "start"
    BACKOFF = "backoff"
    SUCCEED = "succeed"
    HEARTBEAT = "heartbeat"
    FAIL = "fail"


class Why(enum.Enum):
    CRASHED = "crashed"


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Job(Tracked):
    start: ClassVar[Trigger]
    backoff: ClassVar[Trigger]
    succeed: ClassVar[Trigger]
    fail: ClassVar[Trigger]


TABLE = make_table(
    "job",
    S,
    events=E,
    initial=S.QUEUED,
    finals=(S.SUCCEEDED, S.FAILED),
    edges=(
        Edge(E.START, S.QUEUED, S.RUNNING),
        Edge(E.BACKOFF, S.RUNNING, S.QUEUED),
        Edge(E.SUCCEED, S.RUNNING, S.SUCCEEDED),
        Edge(E.HEARTBEAT, S.RUNNING, S.RUNNING),  # a self-loop: the batch path checks it apart
        *(Edge(E.FAIL, s, S.FAILED) for s in (S.QUEUED, S.RUNNING)),
    ),
    failure_events=(E.FAIL,),
    on_enter={f: ("notify",) for f in (S.SUCCEEDED, S.FAILED)},
    reasons=Why,
    record=Job,
)


class Owner:
    def __init__(self, raising: str = "") -> None:
        self.notified: list[str] = []
        self.raising = raising
        self.lc: Lifecycle[Job] = Lifecycle(TABLE, {"notify": self.notify}, check=True)

    def notify(self, job: Job) -> None:
        self.notified.append(job.rid)
        if job.rid == self.raising:
            raise RuntimeError("the pager is down")

    def jobs(self, *rids: str, kind: type[Job] = Job) -> list[Job]:
        out = [kind(rid) for rid in rids]
        for j in out:
            self.lc.admit(j)
        return out


def _snapshot(o: Owner, jobs: list[Job]) -> object:
    return (
        [(j.state, j.reason, j.detail, list(j.timeline)) for j in jobs],
        {s: list(o.lc.in_state(s)) for s in TABLE.live_states()},
        dict(o.lc.finished),
        list(o.notified),
        o.lc.transitions_fired,
    )


# -- 1. fail() is all or none -------------------------------------------------------------


@pytest.mark.parametrize("order", ["bca", "abc"])
def test_fail_checks_every_request_before_any_moves(order: str) -> None:
    o = Owner()
    a, b, c = o.jobs("a", "b", "c")
    c.start()
    a.fail()  # a ended
    before = _snapshot(o, [a, b, c])
    batch = [{"a": a, "b": b, "c": c}[x] for x in order]
    with pytest.raises(IllegalTransition, match="request 'a' in state FAILED cannot take event"):
        o.lc.fail(batch, Why.CRASHED)
    assert _snapshot(o, [a, b, c]) == before
    assert (b.state, c.state) == (S.QUEUED, S.RUNNING) and o.notified == ["a"]


def test_fail_refuses_any_bad_request_of_a_mixed_batch_and_changes_nothing() -> None:
    o = Owner()
    a, b, c = o.jobs("a", "b", "c")
    b.start()
    (stranger,) = Owner().jobs("s")
    before = _snapshot(o, [a, b, c])
    with pytest.raises(LifecycleError, match="'s' belongs to another lifecycle"):
        o.lc.fail([a, b, stranger], Why.CRASHED)
    with pytest.raises(LifecycleError, match="appears twice"):
        o.lc.fail([a, b, c, b], Why.CRASHED)
    with pytest.raises(LifecycleError, match="'n' was never admitted"):
        o.lc.fail([a, b, Job("n")], Why.CRASHED)

    class Other(enum.Enum):
        X = 1

    with pytest.raises(LifecycleError, match="is not a Why"):
        o.lc.fail([a, b], Other.X)
    assert _snapshot(o, [a, b, c]) == before
    o.lc.fail(iter([a, b, c]), Why.CRASHED, "host lost")  # any iterable, read once
    assert [(j.state, j.reason, j.detail) for j in (a, b, c)] == [
        (S.FAILED, Why.CRASHED, "host lost")
    ] * 3
    assert o.lc.finished == {(S.FAILED, Why.CRASHED): 3} and len(o.lc) == 0


def test_fail_takes_only_failure_events() -> None:
    o = Owner()
    (a,) = o.jobs("a")
    a.start()
    with pytest.raises(LifecycleError, match="event 'succeed' is not a failure event of table"):
        o.lc.fail([a], None, event=E.SUCCEED)
    assert a.state is S.RUNNING and not o.notified


def test_fail_moves_every_group_when_a_hook_raises() -> None:
    o = Owner(raising="a")
    a, b = o.jobs("a", "b")
    b.start()
    with pytest.raises(HookFailed) as info:
        o.lc.fail([a, b], Why.CRASHED)  # two groups: QUEUED's hook raises, RUNNING's moves too
    assert a.state is b.state is S.FAILED and sorted(o.notified) == ["a", "b"]
    assert [(rid, hook) for rid, hook, _ in info.value.errors] == [("a", "notify")]


# -- 2. in_state is a read-only view ------------------------------------------------------


def test_in_state_is_a_read_only_view_of_the_index() -> None:
    o = Owner()
    a, b = o.jobs("a", "b")
    queued = o.lc.in_state(S.QUEUED)
    with pytest.raises(TypeError):
        queued["x"] = a  # type: ignore[index]
    for mutate in ("clear", "pop", "popitem", "update", "setdefault"):
        assert not hasattr(queued, mutate), mutate
    assert dict(queued) == {"a": a, "b": b}
    a.start()  # a view, not a copy: it follows the index
    assert list(queued) == ["b"] and list(o.lc.in_state(S.RUNNING).values()) == [a]
    assert o.lc.in_state(S.QUEUED) is queued  # the same view every time: nothing is built
    o.lc.check_index()


# -- 3. the packages are typed ------------------------------------------------------------


@pytest.mark.parametrize("package", ["lifecycle", "scheduler", "kv"])
def test_packages_ship_a_py_typed_marker(package: str) -> None:
    """PEP 561: without the marker, mypy in a user's project does not read ``lifecycle`` (and
    ``ClassVar[Trigger]`` gives nothing). The marker must exist and be shipped as package
    data (the wheel built from pyproject.toml then holds ``lifecycle/py.typed``)."""
    root = Path(__file__).resolve().parent.parent
    assert (root / package / "py.typed").is_file()
    with open(root / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert any(
        package == p or package.startswith(p.rstrip("*"))
        for p in setuptools["packages"]["find"]["include"]
    )
    assert "py.typed" in setuptools["package-data"][package]


# -- 4. a failure reason goes only with an event into a failure state ---------------------


def test_a_failure_reason_is_refused_on_an_event_that_does_not_fail() -> None:
    o = Owner()
    a, b = o.jobs("a", "b")
    o.lc.fire(E.START, [a, b])
    before = _snapshot(o, [a, b])
    says = "event 'succeed' leads to SUCCEEDED, not a failure state: .* \\(fail\\) leads to"
    with pytest.raises(LifecycleError, match=says):
        a.succeed(reason=Why.CRASHED)
    with pytest.raises(LifecycleError, match=says):
        a.fire(E.SUCCEED, reason=Why.CRASHED)
    with pytest.raises(LifecycleError, match=says):
        o.lc.fire(E.SUCCEED, [a, b], reason=Why.CRASHED)
    with pytest.raises(LifecycleError, match="not a failure event"):
        o.lc.fail([a], Why.CRASHED, event=E.SUCCEED)
    assert o.lc.refusal(a, E.SUCCEED, reason=Why.CRASHED).startswith(
        "event 'succeed' leads to SUCCEEDED, not a failure state"
    )
    assert _snapshot(o, [a, b]) == before
    a.succeed("done early")  # a detail still goes with any event that ends a request
    assert (a.state, a.reason, a.detail) == (S.SUCCEEDED, None, "done early")
    b.fail("lost", reason=Why.CRASHED)
    assert (b.state, b.reason, b.detail) == (S.FAILED, Why.CRASHED, "lost")


# -- 5. a hook that is not callable is refused up front -----------------------------------


@pytest.mark.parametrize("hook", [3, None, "notify"])
def test_a_hook_that_is_not_callable_is_refused_when_the_lifecycle_is_built(hook: object) -> None:
    with pytest.raises(MissingHook, match=r"job: hook 'notify' is not callable \(got "):
        Lifecycle(TABLE, {"notify": hook})  # type: ignore[dict-item]


# -- 6. event names ------------------------------------------------------------------------


class Plain(enum.IntEnum):
    FAILED = 0
    QUEUED = 1
    DONE = 2


@pytest.mark.parametrize(
    ("event", "says"),
    [
        ("state", "is a name every record uses (Tracked.state)"),
        ("fire", "is a name every record uses (Tracked.fire)"),
        ("owner", "is a name every record uses (Tracked.owner)"),
        ("timeline", "is a name every record uses (Tracked.timeline)"),
        ("rid", "is a name every record uses (Tracked.rid)"),
        ("", "is not a Python identifier"),
        ("go now", "is not a Python identifier"),
        ("go-now", "is not a Python identifier"),
        ("class", "is a Python keyword"),
        ("admitted", "is the name timelines give a request's admission"),
    ],
)
@pytest.mark.parametrize("with_record", [False, True], ids=["plain", "record"])
def test_event_names_are_refused_the_same_with_or_without_a_record(
    event: str, says: str, with_record: bool
) -> None:
    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class Rec(Tracked):
        pass

    with pytest.raises(InvalidTable) as info:
        make_table(
            "plain",
            Plain,
            initial=Plain.QUEUED,
            finals=(Plain.DONE, Plain.FAILED),
            edges=(Edge(event, Plain.QUEUED, Plain.DONE), Edge("x", Plain.QUEUED, Plain.FAILED)),
            record=Rec if with_record else None,
        )
    assert str(info.value).startswith(f"plain: event {event!r} ") and says in str(info.value)
    assert not hasattr(Rec, "x")  # refused before any trigger method was made


def test_an_event_enum_with_a_reserved_value_is_refused() -> None:
    class Bad(enum.StrEnum):
        GO = "go"
        STATE = "state"

    with pytest.raises(InvalidTable, match="plain: event 'state' is a name every record uses"):
        make_table(
            "plain",
            Plain,
            events=Bad,
            initial=Plain.QUEUED,
            finals=(Plain.DONE, Plain.FAILED),
            edges=(Edge(Bad.GO, Plain.QUEUED, Plain.DONE),
                   Edge(Bad.STATE, Plain.QUEUED, Plain.FAILED)),
        )


# -- 7. a copy of a tracked record, or a state assigned by hand, cannot fire ---------------

COPIES = {"copy.copy": copy.copy, "attrs.evolve": attrs.evolve}


@attrs.define
class EqualJob(Job):
    """attrs' default eq=True: a copy compares equal to the record it was copied from."""


@pytest.mark.parametrize("kind", [Job, EqualJob], ids=["eq=False", "eq=True"])
@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_of_a_tracked_record_cannot_fire(how: str, kind: type[Job]) -> None:
    """Records are matched by identity: a copy that compares equal is still a copy."""
    o = Owner()
    a, b, c = o.jobs("a", "b", "c", kind=kind)
    o.lc.fire(E.START, [b, c])
    qa, rb = COPIES[how](a), COPIES[how](b)
    before = _snapshot(o, [a, b, c])
    says = "request '{}' is a copy of a tracked record .* a copy cannot fire"
    attempts = [
        ("a", lambda: qa.start()),  # the trigger path
        ("a", lambda: o.lc.trigger(qa, E.FAIL)),
        ("a", lambda: o.lc.fire(E.START, [qa])),  # the whole of QUEUED, but not its record
        ("b", lambda: o.lc.fire(E.SUCCEED, [rb])),  # part of RUNNING, into a final state
        ("b", lambda: o.lc.fire(E.BACKOFF, [c, rb])),  # part of RUNNING, into a live state
        ("b", lambda: o.lc.fire(E.HEARTBEAT, [rb, c])),  # a self-loop
        ("b", lambda: o.lc.fire(E.SUCCEED, [b, rb])),  # the record and its copy
        ("a", lambda: o.lc.fail([b, qa], Why.CRASHED)),
    ]
    for rid, attempt in attempts:
        with pytest.raises(LifecycleError, match=says.format(rid)):
            attempt()
        assert _snapshot(o, [a, b, c]) == before  # no hook ran, nothing moved
    assert "is a copy of a tracked record" in o.lc.refusal(qa, E.START)
    # The records themselves still fire.
    a.start()
    o.lc.fire(E.SUCCEED, [a, b, c])
    assert [j.state for j in (a, b, c)] == [S.SUCCEEDED] * 3 and o.notified == ["a", "b", "c"]
    o.lc.check_index()


def test_a_record_whose_state_was_assigned_by_hand_cannot_fire() -> None:
    o = Owner()
    a, b = o.jobs("a", "b")
    b.start()
    a.state = S.RUNNING  # behind the lifecycle's back: it files a under QUEUED
    says = "request 'a' is filed under QUEUED but its state says RUNNING: .* assigned by hand"
    for attempt in (
        lambda: a.succeed(),
        lambda: o.lc.fire(E.SUCCEED, [a]),
        lambda: o.lc.fire(E.BACKOFF, [b, a]),
        lambda: o.lc.fire(E.HEARTBEAT, [a, b]),
        lambda: o.lc.fail([a], Why.CRASHED),
        # An event the assigned state has no edge for: it said IllegalTransition, which a
        # caller takes for an ordinary refusal.
        lambda: a.start(),
        lambda: o.lc.fire(E.START, [a]),
    ):
        with pytest.raises(LifecycleError, match=says) as raised:
            attempt()
        assert not isinstance(raised.value, IllegalTransition)
    assert "assigned by hand" in o.lc.refusal(a, E.SUCCEED)
    assert "assigned by hand" in o.lc.refusal(a, E.START)
    a.state = S.SUCCEEDED  # a final state, by hand: the record is still live
    with pytest.raises(LifecycleError, match="filed under QUEUED but its state says SUCCEEDED"):
        a.start()
    assert b.state is S.RUNNING and not o.notified
    assert dict(o.lc.in_state(S.QUEUED)) == {"a": a}
    a.state = S.QUEUED  # put back, it fires again
    a.start()
    o.lc.check_index()


def test_a_record_built_in_another_state_is_refused_at_admission() -> None:
    """It was admitted, its state silently reset to the initial one."""
    o = Owner()
    with pytest.raises(LifecycleError, match="request 'm' was built in state RUNNING: a record "
                                             "starts in the initial state QUEUED"):
        o.lc.admit(Job("m", state=S.RUNNING))
    assert "m" not in o.lc
    built_queued = Job("q", state=S.QUEUED)  # the initial state itself is fine
    o.lc.admit(built_queued)
    assert built_queued.state is S.QUEUED and "q" in o.lc


def test_a_copy_of_an_ended_record_cannot_fire() -> None:
    o = Owner()
    (a,) = o.jobs("a")
    stale = copy.copy(a)
    a.fail()
    with pytest.raises(LifecycleError, match="'a' says QUEUED, but it is not live in this"):
        stale.start()
    assert o.notified == ["a"] and len(o.lc) == 0


# -- 8. what refusals say ------------------------------------------------------------------


def test_a_batch_with_a_record_never_admitted_says_so() -> None:
    o = Owner()
    (b,) = o.jobs("b")
    before = _snapshot(o, [b])
    for batch in ([b, Job("q")], [Job("q"), b]):
        with pytest.raises(LifecycleError, match="request 'q' was never admitted to a lifecycle"):
            o.lc.fire(E.START, batch)
    assert _snapshot(o, [b]) == before


def test_a_batch_names_the_state_a_stray_request_is_in_even_when_its_value_is_zero() -> None:
    o = Owner()
    a, b, c = o.jobs("a", "b", "c")
    c.fail()  # FAILED == 0
    with pytest.raises(IllegalTransition) as info:
        o.lc.fire(E.START, [a, c, b])
    assert (info.value.rid, info.value.state) == ("c", S.FAILED)
    assert str(info.value) == (
        "request 'c' in state FAILED cannot take event 'start': the batch is in state QUEUED"
    )


def test_events_are_named_by_their_names_on_every_path() -> None:
    o = Owner()
    (b,) = o.jobs("b")
    said = "request 'b' in state QUEUED cannot take event 'backoff': QUEUED has no 'backoff' edge"
    for attempt in (
        lambda: b.backoff(),
        lambda: b.fire(E.BACKOFF),
        lambda: o.lc.trigger(b, E.BACKOFF),
        lambda: o.lc.fire(E.BACKOFF, [b]),
    ):
        with pytest.raises(IllegalTransition) as info:
            attempt()
        assert str(info.value) == said
    assert o.lc.refusal(b, E.BACKOFF) == "QUEUED has no 'backoff' edge"


def test_an_ended_record_is_not_admitted_again_and_says_why() -> None:
    o = Owner()
    (b,) = o.jobs("b")
    b.fail()
    with pytest.raises(LifecycleError) as info:
        o.lc.admit(b)
    assert str(info.value) == (
        "request 'b' ended in FAILED: a record is admitted once; admit a new record to track "
        "the request again"
    )
    assert b.state is S.FAILED and len(o.lc) == 0 and o.notified == ["b"]
    again = Job("b")  # a new record under the same id is a new request
    o.lc.admit(again)
    assert o.lc.get("b") is again


def test_admission_starts_a_timeline_the_record_was_built_with() -> None:
    o = Owner()
    (a,) = o.jobs("a")
    restored = Job("r", timeline=list(a.timeline) * 2)
    o.lc.admit(restored)
    assert [e for _, e in restored.timeline] == ["admitted"]


@pytest.mark.parametrize("given", [
    {"reason": Why.CRASHED}, {"detail": "pre"}, {"reason": Why.CRASHED, "detail": "pre"}])
def test_a_record_built_with_a_reason_or_detail_is_refused_at_admission(
    given: dict[str, object]
) -> None:
    """A reason set before admission used to survive onto an ending without one (a success
    counted in .finished under a failure reason)."""
    o = Owner()
    says = " and ".join(f"{k} {v!r}" for k, v in given.items())
    with pytest.raises(LifecycleError, match=re.escape(
            f"request 'm' was built with {says}: a reason and a detail say how a request ended, "
            f"and only the event that ends it sets them")):
        o.lc.admit(Job("m", **given))  # type: ignore[arg-type]
    assert "m" not in o.lc and not o.lc.finished


def test_admission_gives_the_record_a_timeline_of_its_own() -> None:
    """A record made by attrs.evolve shares its original's timeline list: admitting it leaves
    the original's as it was (it used to empty it in place)."""
    o = Owner()
    (a,) = o.jobs("a")
    kept = list(a.timeline)
    b = attrs.evolve(a, rid="b", owner=None)
    assert b.timeline is a.timeline
    o.lc.admit(b)
    assert a.timeline == kept and b.timeline is not a.timeline
    a.start()
    assert [e for _, e in a.timeline] == ["admitted", "start"]
    assert [e for _, e in b.timeline] == ["admitted"]
    o.lc.check_index()


@pytest.mark.parametrize("detail", [123, 0, None, b"x"])
def test_a_detail_that_is_not_a_string_is_refused_on_every_path(detail: object) -> None:
    """As the trigger methods refuse it: fire, fail, Tracked.fire and refusal took it."""
    o = Owner()
    a, b = o.jobs("a", "b")
    b.start()
    before = _snapshot(o, [a, b])
    says = re.escape(f"detail is a string, got {type(detail).__name__} {detail!r}")
    for attempt in (
        lambda: o.lc.fire(E.FAIL, [a], detail=detail),  # type: ignore[arg-type]
        lambda: o.lc.fail([a, b], None, detail),  # type: ignore[arg-type]
        lambda: a.fire(E.FAIL, detail=detail),  # type: ignore[arg-type]
        lambda: o.lc.trigger(b, E.SUCCEED, detail=detail),  # type: ignore[arg-type]
        lambda: o.lc.refusal(a, E.FAIL, detail=detail),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match=says):
            attempt()
        assert _snapshot(o, [a, b]) == before


def test_a_batch_may_be_any_iterable_read_once() -> None:
    o = Owner()
    a, b, c, d = o.jobs("a", "b", "c", "d")
    o.lc.fire(E.START, (j for j in (a, b)))  # a generator
    assert (a.state, b.state) == (S.RUNNING, S.RUNNING)
    o.lc.fire(E.START, o.lc.in_state(S.QUEUED).values())  # a view of the bucket that moves
    assert c.state is d.state is S.RUNNING and not o.lc.in_state(S.QUEUED)
    o.lc.fire(E.HEARTBEAT, iter([d, c]))
    o.lc.fire(E.SUCCEED, (a, b))  # a tuple
    with pytest.raises(LifecycleError, match="appears twice"):
        o.lc.fire(E.SUCCEED, iter([c, c]))
    o.lc.fire(E.SUCCEED, iter([]))  # nothing to fire
    assert [j.state for j in (a, b, c, d)] == [S.SUCCEEDED] * 2 + [S.RUNNING] * 2
    o.lc.check_index()


def test_one_request_given_where_a_batch_goes_is_refused_by_name() -> None:
    o = Owner()
    (a,) = o.jobs("a")
    with pytest.raises(TypeError, match=r"fire\(\) takes a batch of requests, got the one "
                                        r"request 'a': pass \[request\]"):
        o.lc.fire(E.START, a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fail\(\) takes a batch of requests, got the one "
                                        r"request 'a'"):
        o.lc.fail(a, None)  # type: ignore[arg-type]
    assert a.state is S.QUEUED
