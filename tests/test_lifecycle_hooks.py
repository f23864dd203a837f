"""Hooks as the lifecycle runs them: an event fired from inside a hook (refused at a request of
the call running its hooks, fired as usual at any other), fail() moving every group before any
hook runs, and a hook raising a BaseException that is not an Exception."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import pytest

from lifecycle import (
    Edge,
    Firing,
    HookFailed,
    Lifecycle,
    LifecycleError,
    Tracked,
    Trigger,
    make_table,
)


class S(enum.IntEnum):
    FAILED = 0
    CANCELLED = 1
    NEW = 2
    RUN = 3
    DONE = 4


class Why(enum.Enum):
    PRECHECK = "precheck"


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Job(Tracked):
    held: int = attrs.field(default=0, kw_only=True)
    ok: bool = attrs.field(default=True, kw_only=True)

    start: ClassVar[Trigger]
    finish: ClassVar[Trigger]
    cancel: ClassVar[Trigger]
    fail: ClassVar[Trigger]


LIVE = (S.NEW, S.RUN)
FINALS = (S.DONE, S.CANCELLED, S.FAILED)

TABLE = make_table(
    "jobs",
    S,
    initial=S.NEW,
    finals=FINALS,
    edges=(
        Edge("start", S.NEW, S.RUN, after="check"),
        Edge("finish", S.RUN, S.DONE),
        *(Edge("cancel", s, S.CANCELLED) for s in LIVE),
        *(Edge("fail", s, S.FAILED) for s in LIVE),
    ),
    failure_events=("fail", "cancel"),
    on_enter={S.RUN: "acquire", **{f: "release" for f in FINALS}},
    reasons=Why,
    record=Job,
)


class Owner:
    """Hooks that log what they see; ``on_release`` and ``on_check`` let a test fire events
    from inside them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.on_check: Callable[[Job], None] = lambda job: None
        self.on_release: Callable[[Job], None] = lambda job: None
        self.lc: Lifecycle[Job] = Lifecycle(
            TABLE, {"check": self.check, "acquire": self.acquire, "release": self.release},
            check=True)

    def _seen(self, hook: str, job: Job) -> None:
        assert job.state is not None
        self.log.append((hook, job.rid, job.state.name))

    def check(self, job: Job, event: Firing) -> None:
        self._seen("check", job)
        self.on_check(job)

    def acquire(self, job: Job) -> None:
        self._seen("acquire", job)
        job.held += 1

    def release(self, job: Job) -> None:
        self._seen("release", job)
        job.held = 0
        self.on_release(job)

    def jobs(self, *rids: str) -> list[Job]:
        out = [Job(rid) for rid in rids]
        for j in out:
            self.lc.admit(j)
        return out


REENTRY = (r"request '{}' cannot take event '{}' from inside a hook: the '{}' that moved it "
           r"\(to {}\) is still running its hooks")


@pytest.mark.parametrize("one_by_one", [True, False], ids=["trigger", "batch"])
def test_an_event_a_hook_fires_at_its_own_request_is_refused(one_by_one: bool) -> None:
    """A hook that fails its own request: refused, so the request's hooks run to the end for
    the state it entered (acquire on RUN no longer ran after release on FAILED, leaving an
    ended request holding what it acquired)."""
    o = Owner()
    (j,) = o.jobs("j")
    o.on_check = lambda job: job.fail("precheck failed", reason=Why.PRECHECK)
    with pytest.raises(HookFailed) as info:
        j.start() if one_by_one else o.lc.fire("start", [j])
    ((rid, hook, error),) = info.value.errors
    assert (rid, hook, type(error)) == ("j", "check", LifecycleError)
    assert info.value.__cause__ is error
    assert str(error).startswith(REENTRY.format("j", "fail", "start", "RUN").replace("\\", ""))
    # The wrapper says what took effect, then quotes the refusal once, last: they used to run
    # together ("... once that call has returned for request 'j'; event 'start' took ...").
    assert str(info.value) == (
        "hook 'check' raised for request 'j'; event 'start' took effect: every request it was "
        "fired for is in RUN. The error: LifecycleError: request 'j' cannot take event 'fail' "
        "from inside a hook: the 'start' that moved it (to RUN) is still running its hooks. "
        "Nothing changed; decide it in a guard, or fire it once that call has returned.")
    assert o.log == [("check", "j", "RUN"), ("acquire", "j", "RUN")]
    assert (j.state, j.held, j.reason, j.detail) == (S.RUN, 1, None, "")
    assert [e for _, e in j.timeline] == ["admitted", "start"]
    # Once the call has returned, the owner fires it.
    j.fail("precheck failed", reason=Why.PRECHECK)
    assert (j.state, j.held) == (S.FAILED, 0)
    assert o.log[-1] == ("release", "j", "FAILED")
    assert o.lc.finished == {(S.FAILED, Why.PRECHECK): 1}


def test_an_event_a_hook_fires_at_another_request_of_its_batch_is_refused() -> None:
    o = Owner()
    a, b = o.jobs("a", "b")
    o.on_check = lambda job: b.cancel() if job is a else None
    with pytest.raises(HookFailed, match=REENTRY.format("b", "cancel", "start", "RUN")):
        o.lc.fire("start", [a, b])
    assert [(j.state, j.held) for j in (a, b)] == [(S.RUN, 1), (S.RUN, 1)]
    assert o.log == [("check", "a", "RUN"), ("acquire", "a", "RUN"),
                     ("check", "b", "RUN"), ("acquire", "b", "RUN")]


def test_fail_is_all_or_none_when_a_hook_fires_at_a_request_of_the_call() -> None:
    """fail() moves every group before any hook runs: a hook of one group firing at a request
    of another is refused, where it used to end that request first and leave fail() raising
    IllegalTransition with the first group failed and the second not."""
    o = Owner()
    a, b = o.jobs("a", "b")
    a.start()
    o.log.clear()
    o.on_release = lambda job: b.cancel("sibling") if job is a else None
    with pytest.raises(HookFailed, match=REENTRY.format("b", "cancel", "fail", "FAILED")):
        o.lc.fail([a, b], Why.PRECHECK, "out of stock")
    assert [(j.state, j.reason, j.detail) for j in (a, b)] == [
        (S.FAILED, Why.PRECHECK, "out of stock")] * 2
    assert o.log == [("release", "a", "FAILED"), ("release", "b", "FAILED")]
    assert o.lc.finished == {(S.FAILED, Why.PRECHECK): 2}
    assert len(o.lc) == 0


def test_a_hook_fires_at_other_requests_as_usual() -> None:
    """Outside the call running its hooks, a request fires as ever, its hooks inside the
    hook; one of those firing back at a request of the outer call is refused."""
    o = Owner()
    a, b, c = o.jobs("a", "b", "c")
    o.lc.fire("start", [a, b])
    o.log.clear()
    refused: list[str] = []

    def release(job: Job) -> None:
        if job is a:
            c.cancel("a ended")  # c is not a's call's: it ends now, its release runs here
        elif job is c:
            try:
                a.cancel()  # a's call is still running its hooks
            except LifecycleError as exc:
                refused.append(str(exc))
            b.finish()

    o.on_release = release
    a.finish()
    assert [j.state for j in (a, b, c)] == [S.DONE, S.DONE, S.CANCELLED]
    assert o.log == [("release", "a", "DONE"), ("release", "c", "CANCELLED"),
                     ("release", "b", "DONE")]
    assert len(refused) == 1 and "request 'a' cannot take event 'cancel' from inside" in refused[0]
    assert o.lc.finished == {(S.DONE, None): 2, (S.CANCELLED, None): 1}


@pytest.mark.parametrize("error", [asyncio.CancelledError, KeyboardInterrupt])
@pytest.mark.parametrize("how", ["fire", "fail"])
def test_a_hook_raising_a_base_exception_does_not_stop_the_others(
    error: type[BaseException], how: str
) -> None:
    """Every request moved, so every one's hooks run; then the first BaseException that is
    not an Exception is raised itself (a cancelled task stays cancelled), with a note."""
    o = Owner()
    a, b, c = o.jobs("a", "b", "c")
    c.start()
    o.log.clear()

    def release(job: Job) -> None:
        if job is a:
            raise error()
        if job is b:
            raise RuntimeError("the pager is down")

    o.on_release = release
    with pytest.raises(error) as info:
        if how == "fire":
            o.lc.fire("cancel", [a, b])
            c.cancel()
        else:
            o.lc.fail([a, c, b], None, event="cancel")
    assert [j.state for j in (a, b)] == [S.CANCELLED] * 2
    released = [rid for hook, rid, _ in o.log if hook == "release"]
    assert released == (["a", "b"] if how == "fire" else ["a", "b", "c"])
    assert info.value.__notes__ == [
        "lifecycle: raised by a hook; event 'cancel' took effect: every request it was fired "
        f"for is in CANCELLED, and every hook ran (hooks that raised: 'release' for 'a': "
        f"{error.__name__}; 'release' for 'b': RuntimeError)"]
    assert len(o.lc) == (1 if how == "fire" else 0)
    o.lc.check_index()


def test_hook_errors_are_the_hooks_own_in_the_order_they_ran() -> None:
    o = Owner()
    (a,) = o.jobs("a")
    boom = RuntimeError("boom")

    def raising(job: Any) -> None:
        raise boom

    o.on_check = raising
    with pytest.raises(HookFailed) as info:
        a.start()
    assert info.value.errors == (("a", "check", boom),) and info.value.__cause__ is boom
    assert a.state is S.RUN and a.held == 1
